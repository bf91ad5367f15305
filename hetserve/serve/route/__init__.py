"""``hetserve route``: hetserve's front end in front of OpenAI-compatible backends (vLLM, SGLang,
``hetserve serve``): placement by the plan's weights or a placement policy, health checks, retry
of requests that have not streamed yet, vLLM's disaggregated-proxy protocol for P/D, per-backend
Prometheus metrics. ``backends`` holds the decisions, ``app`` the forwarding, ``server`` the HTTP app."""
