# SMetric's router image for vLLM production-stack: the chart passes its router arguments to the
# entry point (`smetric router` takes production-stack's router flags unchanged).
#   docker build -t smetric-router:0.1.0 .
FROM python:3.11-slim

WORKDIR /opt/smetric
COPY pyproject.toml README.md ./
COPY smetric_lmc smetric_lmc
COPY controller controller
COPY workers workers
COPY configs configs
# k8s: pod discovery with the official client; indexer: the optional llm-d GetPodScores gRPC API
RUN pip install --no-cache-dir '.[k8s,indexer]' && useradd --uid 1000 --create-home smetric
USER 1000

# router HTTP (the chart's containerPort), LMCache controller pull / reply / heartbeat
EXPOSE 8000 9000 9001 9002
ENTRYPOINT ["smetric", "router"]
