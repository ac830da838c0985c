# One image for every process of the federation: scheduler, gateway, site agents (with
# emulated workers), WAN link proxies. `docker compose up --build` runs the embedded default.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY core core
COPY federation federation
COPY scheduler scheduler
COPY nodes nodes
COPY proto proto
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
