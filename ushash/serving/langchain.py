"""A LangChain cache (`langchain_core.caches.BaseCache`) backed by a `SemanticCache`.

    from langchain_core.globals import set_llm_cache
    set_llm_cache(USHashLangChainCache(SemanticCache.from_export("exports/<name>")))
    llm.invoke("What is a frog?")        # a miss calls the model; "what's a frog" may then hit

The prompt LangChain hands a cache is a chat model's messages serialised (`langchain_core.load.dumps`) or
an LLM's plain text. The request is keyed by its semantics: a message list that carries an image (an
OpenAI-style `image_url` part with a base64 data URL) is looked up by the image, with its text required
to match exactly (a metadata filter); otherwise by the text of every message joined. Its shape (which
messages hold text and which images, part by part) is an exact filter: a prompt without an image, or with
it in another message, never gets the answer of one with it there. The model and its settings
(`llm_string`) are a metadata filter too: one model's answer is never served for another.
Generations are stored as `langchain_core.load.dumps` JSON. Needs the `langchain` extra.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Optional, Sequence

from langchain_core.caches import RETURN_VAL_TYPE, BaseCache
from langchain_core.load import dumps, loads
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, Generation

from ushash.serving.cache import RequestError
from ushash.serving.messages import content_form, decode_data_url, images_digest, json_digest, read_content

_ALLOWED = [ChatGeneration, Generation, AIMessage, AIMessageChunk, ChatGenerationChunk]


def parse_prompt(prompt: str) -> tuple[str, list[bytes], Optional[str], str, str]:
    """(the text of every message joined by newlines, the images, a digest of the rest, a digest of the texts
    one by one, a digest of the texts of every message but the last: "" for one message) of a LangChain
    cache prompt. The last is the exact filter of a text prompt's earlier turns (a system prompt, the
    conversation so far): by meaning, "answer in French" and "answer in English" before one question would
    share an answer. The digest of the texts one by one is the exact filter on the text of a prompt looked up
    by its image: the joined text is ambiguous (parts "a\\nb", "c" and "a", "b\\nc" join alike). The rest is
    every message with its content less its texts and images (`content_form`: the parts' types and order, an
    image's media type and detail, any other key of a part), and its class, name, tool calls, ...: an answer
    depends on them too, and on where an image stands in the conversation, so it is an exact filter. None
    for a prompt holding content the cache cannot read (an image that is not a base64 data URL, a part of
    another type): keyed by the rest of it, two such prompts would share an answer, so it is not cached."""
    try:
        msgs = json.loads(prompt)
    except (ValueError, RecursionError):
        return prompt, [], "", json_digest([prompt]), ""
    if not (isinstance(msgs, list) and msgs and all(map(_serialised_message, msgs))):
        # a plain LLM's prompt (one that happens to be a JSON array of records too) is its own text
        return prompt, [], "", json_digest([prompt]), ""
    texts, images, rest, before = [], [], [], 0
    for m in msgs:
        kw = m.get("kwargs", {})
        kw = kw if isinstance(kw, dict) else {}
        role = m["id"][-1]
        t, i, complete = read_content(kw.get("content"))
        if not complete:
            return "", [], None, "", ""
        before = len(texts)   # the texts before the last message's
        texts += [f"{role}: {x}" for x in t] if len(msgs) > 1 else t
        images += i
        kept = {k: v for k, v in kw.items() if k != "content"}
        rest.append({**m, "kwargs": {**kept, "content": content_form(kw.get("content"))}})
    return "\n".join(texts), images, json_digest(rest), json_digest(texts), json_digest(texts[:before]) if before else ""


def _serialised_message(m) -> bool:
    """A message as langchain_core's `dumps` writes a chat model's prompt: {"lc": 1, "type": "constructor",
    "id": [..., "HumanMessage"], "kwargs": {...}}."""
    return (isinstance(m, dict) and m.get("lc") == 1 and isinstance(m.get("id"), list) and bool(m["id"])
            and all(isinstance(x, str) for x in m["id"]))


class USHashLangChainCache(BaseCache):
    """LangChain's cache interface on a SemanticCache. `featurize(modality, data) -> features` replaces
    the export's own encoder (tests, or features computed elsewhere); `tenant` scopes the entries."""

    def __init__(self, cache, tenant: str = "default", featurize: Optional[Callable[[str, Any], Any]] = None):
        self.cache = cache
        self.tenant = cache.check_tenant(tenant)
        self.featurize = featurize

    def _request(self, prompt: str, llm_string: str) -> Optional[tuple[str, Any, Any, dict]]:
        """(modality, data, features, metadata filters) of a prompt; None for one it does not cache."""
        text, images, rest, texts_key, context = parse_prompt(prompt)
        if rest is None:
            return None
        llm = hashlib.sha256(llm_string.encode()).hexdigest()[:32]
        meta = {"llm": llm, "rest": rest}
        if images and "image" in self.cache.head.modalities:
            meta.update(text=texts_key, more_images=images_digest(images[1:]))
            modality, data = "image", images[0]
        elif images:   # a head without images cannot tell them apart: keyed by the text, they would share answers
            return None
        else:
            meta["context"] = context
            modality, data = "text", text
        if self.featurize is not None:
            return modality, None, self.featurize(modality, data), meta
        return modality, data, None, meta

    def lookup(self, prompt: str, llm_string: str) -> RETURN_VAL_TYPE | None:
        req = self._request(prompt, llm_string)
        if req is None:
            return None
        modality, data, feats, meta = req
        try:
            hits = self.cache.check(data, modality, features=feats, filters=meta, tenant=self.tenant)
        except RequestError:   # what the cache cannot key (a text over its encoder's window, ...): a miss
            return None
        if not hits:
            return None
        try:
            # an L2 is shared: revive only generations and messages, never arbitrary classes
            return loads(hits[0]["response"], allowed_objects=_ALLOWED)
        except (ValueError, TypeError, KeyError):
            return None

    def update(self, prompt: str, llm_string: str, return_val: Sequence) -> None:
        req = self._request(prompt, llm_string)
        if req is None:
            return
        modality, data, feats, meta = req
        try:
            self.cache.store(data, dumps(list(return_val)), modality, features=feats, metadata=meta, tenant=self.tenant)
        except RequestError:   # not stored, as it was not looked up
            return

    def clear(self, **kwargs: Any) -> None:
        """Drop this tenant's L1 entries."""
        self.cache.delete_tenant(self.tenant)


__all__ = ["USHashLangChainCache", "decode_data_url", "parse_prompt"]
