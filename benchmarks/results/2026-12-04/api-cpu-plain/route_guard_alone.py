import asyncio, time, statistics, json
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from vllm_xmix._vllm_compat.api_server import SelectionRouteGuard

def make(mw):
    app = FastAPI()
    @app.post("/v1/completions")
    async def comp(request: Request):
        body = await request.json()
        async def gen():
            for i in range(64):
                await asyncio.sleep(0)
                yield f"data: {{\"i\": {i}}}\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")
    if mw:
        app.add_middleware(SelectionRouteGuard)
    return app

async def run(app, n=300):
    tr = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=tr, base_url="http://t") as c:
        body = {"model": "m", "prompt": [1,2,3], "max_tokens": 64, "stream": True}
        t = time.process_time()
        for _ in range(n):
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
        return (time.process_time() - t) / n * 1e6

async def main():
    a, b = make(False), make(True)
    res = {False: [], True: []}
    for _ in range(5):
        for mw, app in ((False, a), (True, b)):
            res[mw].append(await run(app))
    for k, v in res.items():
        print("middleware" if k else "none", round(statistics.median(v), 1), "us per request", [round(x) for x in v])
asyncio.run(main())
