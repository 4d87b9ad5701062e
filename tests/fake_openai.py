"""A fake OpenAI-shaped replica for the canary tests: streams a few SSE chunks after a fixed
"prefill" delay, so TTFT is known and the same on every replica (helper module, not a test)."""

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def fake_replica(name: str, prefill_s: float = 0.03, chunks: int = 3) -> FastAPI:
    app = FastAPI()
    app.state.served = 0

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.served += 1

        async def events():
            await asyncio.sleep(prefill_s)
            for i in range(chunks):
                yield f"data: {json.dumps({'i': i, 'replica': name})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        if not body.get("stream"):
            await asyncio.sleep(prefill_s)
            return {"object": "text_completion", "model": name,
                    "choices": [{"index": 0, "text": f"hi from {name}"}]}
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        from fastapi.responses import PlainTextResponse

        return PlainTextResponse(f'labkit:num_requests_waiting{{model_name="{name}"}} 0\n')

    return app
