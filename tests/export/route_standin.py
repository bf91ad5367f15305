"""A stand-in OpenAI-compatible backend for the route tests (run as a process, so a test can kill it).

    python tests/export/route_standin.py --port P --id b0 [--role colocated|prefill|decode]
        [--first-byte-delay 0.2] [--chunk-delay 0.02]

Answers /v1/completions and /v1/chat/completions with ``max_tokens`` tokens named ``<id>-<i>``
(streamed as SSE when asked), /health, /v1/models, and /stats (requests served, and every protocol
problem seen). As a vLLM prefill server (``--role prefill``) it checks the disaggregated-proxy
fields (vLLM's toy_proxy_server.py) and answers with ``kv_transfer_params`` naming itself; as a
decode server it checks that the request carries a prefill's ``kv_transfer_params``.
"""

import argparse
import asyncio
import itertools
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def build(args):
    app = FastAPI()
    stats = {"served": 0, "problems": [], "kv_from": {}}
    blocks = itertools.count(1)

    def problem(msg):
        stats["problems"].append(msg)
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error"}}, status_code=400)

    async def generate(request: Request):
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        extra = {}
        if args.role == "prefill":
            if body.get("kv_transfer_params") != PREFILL_KV:
                return problem(f"prefill: kv_transfer_params {body.get('kv_transfer_params')}")
            if body.get("max_tokens") != 1 or body.get("stream") is not False or "stream_options" in body \
                    or "min_tokens" in body:
                return problem(f"prefill: fields {sorted(body)} max_tokens={body.get('max_tokens')} "
                               f"stream={body.get('stream')}")
            extra["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                           "remote_engine_id": f"engine-{args.id}", "remote_block_ids": [next(blocks)],
                                           "remote_host": "127.0.0.1", "remote_port": args.port}
        if args.role == "decode":
            kv = body.get("kv_transfer_params") or {}
            if not str(kv.get("remote_engine_id", "")).startswith("engine-") or not kv.get("do_remote_prefill") \
                    or not kv.get("remote_block_ids"):
                return problem(f"decode: kv_transfer_params {kv}")
            src = kv["remote_engine_id"][len("engine-"):]
            stats["kv_from"][src] = stats["kv_from"].get(src, 0) + 1
        stats["served"] += 1
        tokens = [f"{args.id}-{i}" for i in range(n)]
        if not body.get("stream"):
            await asyncio.sleep(args.first_byte_delay)
            return JSONResponse({"id": "cmpl-x", "object": "text_completion", "model": body.get("model"),
                                 "choices": [{"index": 0, "text": " ".join(tokens), "finish_reason": "length"}],
                                 "served_by": args.id, **extra})

        async def events():
            await asyncio.sleep(args.first_byte_delay)
            for t in tokens:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': t}], 'served_by': args.id})}\n\n"
                await asyncio.sleep(args.chunk_delay)
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    app.post("/v1/completions")(generate)
    app.post("/v1/chat/completions")(generate)
    app.get("/health")(lambda: {"status": "ok"})
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
    app.get("/stats")(lambda: stats)
    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--role", default="colocated")
    ap.add_argument("--first-byte-delay", type=float, default=0.0)
    ap.add_argument("--chunk-delay", type=float, default=0.0)
    a = ap.parse_args()
    uvicorn.run(build(a), host="127.0.0.1", port=a.port, log_level="warning")
