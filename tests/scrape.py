"""Reading a Prometheus ``/metrics`` page back into numbers (import as ``from scrape import ...``)."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Scrape:
    """Samples of one scrape: ``value(name, **labels)`` sums every sample that matches."""

    samples: list[tuple[str, dict[str, str], float]]

    def value(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


def parse(text: str) -> Scrape:
    return Scrape([(s.name, dict(s.labels), float(s.value))
                   for fam in text_string_to_metric_families(text) for s in fam.samples])


async def scrape(http: aiohttp.ClientSession, url: str) -> Scrape:
    async with http.get(url) as resp:
        assert resp.status == 200, f"{url}: HTTP {resp.status}"
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse(await resp.text())
