"""``smetric replay``: replay a workload against an OpenAI-compatible endpoint as live agent sessions.

    smetric replay --url http://127.0.0.1:8080 [--trace FILE | --sessions N] [--rate 0.5]
                   [--context-scale 0.05] [--time-scale 0.1] [--records out.jsonl]

Any workload the simulator reads (WEKA, Bailian, Mooncake, native; default: the synthetic agent
workload) goes out as real requests: each turn resends the session's whole context as token ids
that reproduce the trace's block sharing, ``max_tokens`` = recorded output with ``ignore_eos``,
streamed. Prints the simulator's summary tables for what was measured; ``--records`` keeps one
JSON line per request (TTFT, end-to-end, cached_tokens, serving instance and route reason).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from pathlib import Path

from tqdm import tqdm

from smetric_lmc.lab.replay.prompts import TokenSpace
from smetric_lmc.lab.replay.runner import Replay, ReplayAborted, ReplayConfig
from smetric_lmc.lab.replay.summary import summarize_records
from smetric_lmc.lab.sim.config import load_sim_config
from smetric_lmc.lab.sim.report import comparison_table, reasons_table
from smetric_lmc.lab.workload.model import Workload

log = logging.getLogger(__name__)


def load_workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        from smetric_lmc.lab.workload import load_any

        return load_any(args.trace, shared_prefix=args.shared_prefix)
    from smetric_lmc.lab.workload import synthetic

    return synthetic(args.sessions or 16, seed=args.seed)


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    return ReplayConfig(
        url=args.url, model=args.model, rate=args.rate, arrival=args.arrival, time_scale=args.time_scale,
        max_think_s=args.max_think_s, sessions=args.sessions, seed=args.seed, concurrency=args.concurrency,
        context_scale=args.context_scale, output_scale=args.output_scale, max_output=args.max_output,
        max_model_len=args.max_model_len, tokens=TokenSpace(args.vocab_size, args.token_low),
        timeout_s=args.timeout_s, records=Path(args.records) if args.records else None,
        feedback=not args.no_feedback, session_headers=tuple(args.session_header or ()))


def run_replay(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        wl = load_workload(args)
    except (ValueError, OSError) as exc:
        log.error("replay: %s", exc)
        return 2
    print(f"replaying {wl.name} against {cfg.url}: {cfg.arrival} loop, {cfg.rate:g} sessions/s, "
          f"context x{cfg.context_scale:g}, time x{cfg.time_scale:g}")
    bar = tqdm(desc="requests", unit="req", disable=args.quiet)

    def total(n: int) -> None:  # every request is placed before the first is sent
        bar.total = n
        bar.refresh()

    run = Replay(wl, cfg, progress=bar.update, on_total=total)
    # A shell starts background jobs with SIGINT ignored; `kill -INT` should still stop the replay
    # with its summary, as Ctrl-C does in the foreground.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupted = False
    try:
        asyncio.run(run.run())
    except ReplayAborted as exc:
        bar.close()
        log.error("replay: %s", exc)
        return 1
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGINT, previous)
    bar.close()
    records = run.records
    if interrupted:
        print(f"\ninterrupted: {len(records)} of {run.placed_requests} requests measured so far"
              + (f" (records in {cfg.records})" if cfg.records else ""))
        if not records:
            return 130
    res = summarize_records(records, load_sim_config(args.sim_config), args.label)
    print()
    print(comparison_table({res.policy: res}))
    print(reasons_table({res.policy: res}))
    s = res.summary
    print(f"{s['requests']} requests, {s['failed']} failed, {s['rejected']} rejected; "
          f"{s.get('duration_s', 0):.1f} s")
    if args.json:
        print(json.dumps(s, default=float))
    if interrupted:
        return 130
    return 1 if s["failed"] else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="OpenAI-compatible base URL (a gateway or one engine)")
    p.add_argument("--model", default="tiny", help="model name sent in each request")
    p.add_argument("--trace", help="trace file/folder/archive; default: the synthetic agent workload")
    p.add_argument("--shared-prefix", action="store_true", help="WEKA: shared system prompt + tools ids")
    p.add_argument("--sessions", type=int, help="replay N root sessions (synthetic: generate N; default 16)")
    p.add_argument("--rate", type=float, default=0.5, help="root sessions started per second")
    p.add_argument("--arrival", choices=("closed", "open"), default="closed")
    p.add_argument("--time-scale", type=float, default=1.0, help="think times / recorded offsets x this")
    p.add_argument("--max-think-s", type=float, default=600.0, help="clip recorded think times first")
    p.add_argument("--context-scale", type=float, default=1.0, help="prompt lengths x this (<= 1)")
    p.add_argument("--output-scale", type=float, default=1.0,
                   help="output lengths x this (give it with --context-scale, so answers fit the next prompt)")
    p.add_argument("--max-output", type=int, default=None, help="cap max_tokens")
    p.add_argument("--max-model-len", type=int, default=None, help="skip (as rejected) longer requests")
    p.add_argument("--concurrency", type=int, default=256, help="requests in flight at most")
    p.add_argument("--vocab-size", type=int, default=4096, help="token ids stay below this")
    p.add_argument("--token-low", type=int, default=16, help="token ids start here (skip special ids)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit for one request")
    p.add_argument("--records", help="write one JSON line per request here")
    p.add_argument("--no-feedback", action="store_true",
                   help="closed loop: resend the recorded answer tokens instead of the generated ones")
    p.add_argument("--session-header", action="append", metavar="NAME",
                   help="send each session's key in this header (repeatable), for routers with session affinity: "
                        "x-session-id (vLLM's router), X-SMG-Routing-Key (SGLang's), X-SMetric-Session (ours)")
    p.add_argument("--sim-config", help="SLO and TPS definitions (default: configs/sim.yaml)")
    p.add_argument("--label", help="row name in the table (default: the policy the gateway reports)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("replay", help="replay a workload against an OpenAI-compatible endpoint",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run_replay)


# ---- `smetric sim calibrate` / `smetric sim validate` (registered by replay/sim_cli.py) ----------------
def run_calibration_action(args: argparse.Namespace) -> int:
    if args.action == "calibrate":
        from smetric_lmc.lab.replay.calibrate import calibrate

        if not args.engine or not args.out:
            log.error("smetric sim calibrate needs --engine URL and --out profile.yaml")
            return 2
        cal = calibrate(args.engine, Path(args.out), base=args.profile,
                        model_dir=Path(args.model_dir) if args.model_dir else None,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        engine_log=Path(args.engine_log) if args.engine_log else None)
        print(cal.report())
        print(f"wrote {args.out} (use: smetric sim --profile {args.out})")
        return 0
    from smetric_lmc.lab.replay.validate import real_available, validate_real

    why = real_available()
    if why:
        log.error("smetric sim validate: %s", why)
        return 2
    from smetric_lmc.lab.replay.validate import DEFAULT_POLICIES

    policies = tuple(args.policies.split(",")) if args.policies else DEFAULT_POLICIES
    out = validate_real(Path(args.out or "validate-out"), engines=args.engines, policies=policies,
                       repeats=args.repeats, num_gpu_blocks=args.kv_blocks)
    print(json.dumps(out))
    return 0
