"""The LangChain cache adapter (ushash.serving.langchain) with langchain-core's fake chat models: a miss
calls the model, a repeat and a near paraphrase hit, another model or another image text never does."""

import asyncio
import base64
import hashlib

import numpy as np
import pytest

pytest.importorskip("langchain_core")
from langchain_core.load import dumps  # noqa: E402
from langchain_core.language_models.fake_chat_models import FakeListChatModel, GenericFakeChatModel  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402

from ushash.serving.cache import SemanticCache  # noqa: E402
from ushash.serving.cache.lsh import LSHHead  # noqa: E402
from ushash.serving.langchain import USHashLangChainCache, decode_data_url, parse_prompt  # noqa: E402

DIM = 64

#: how langchain_core's dumps writes a human message's head, in a hand-written prompt
HUMAN = '"lc": 1, "type": "constructor", "id": ["langchain", "schema", "messages", "HumanMessage"], '


def featurize(modality, data):
    """Bag of words (text) or a byte hash (image) into DIM floats: near texts give near features."""
    v = np.zeros(DIM, np.float32)
    if modality == "text":
        for w in data.lower().replace("?", " ").split():
            v[int(hashlib.md5(w.encode()).hexdigest(), 16) % DIM] += 1.0
    else:
        v[:] = np.frombuffer(hashlib.sha512(data).digest(), np.uint8)[:DIM] / 255.0 - 0.5
    return v


@pytest.fixture
def lc_cache():
    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=48, aligned=True, seed=0)
    cache = SemanticCache(head, {"radius": 10, "payload_threshold": 0.85, "cross_modal": False})
    return USHashLangChainCache(cache, featurize=featurize)


def test_fake_chat_model_hits_on_a_repeat_and_a_paraphrase(lc_cache):
    llm = FakeListChatModel(responses=["frogs are amphibians", "second answer", "third", "fourth"], cache=lc_cache)
    assert llm.invoke("what is a frog").content == "frogs are amphibians"
    assert llm.invoke("what is a frog").content == "frogs are amphibians"       # served from the cache
    assert llm.invoke("What is a frog?").content == "frogs are amphibians"      # near: same words
    # a paraphrase with other words: other features, within the radius and the payload threshold
    assert llm.invoke("tell me what a frog is").content == "frogs are amphibians"
    hit = lc_cache.cache.check(None, "text", features=featurize("text", "tell me what a frog is"))[0]
    assert 0 < hit["hamming_distance"] <= 10 and 0.85 <= hit["cosine"] < 0.99
    assert llm.i == 1                                                          # the model ran once
    assert llm.invoke("what is a toad").content == "second answer"             # near in words, not served
    assert llm.invoke("explain quantum chromodynamics please").content == "third"
    assert llm.i == 3
    # another model (another llm_string) never gets this model's answer
    assert GenericFakeChatModel(messages=iter([AIMessage("generic")]), cache=lc_cache).invoke(
        "what is a frog").content == "generic"


def test_multimodal_messages_are_keyed_by_the_image_and_their_text(lc_cache):
    png = base64.b64encode(b"\x89PNG pretend image bytes").decode()
    def msg(text, data=png):
        return [HumanMessage(content=[{"type": "text", "text": text},
                                      {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}])]
    llm = GenericFakeChatModel(messages=iter([AIMessage("a cat"), AIMessage("two"), AIMessage("three")]),
                               cache=lc_cache)
    assert llm.invoke(msg("what is in this image")).content == "a cat"
    assert llm.invoke(msg("what is in this image")).content == "a cat"          # hit
    assert llm.invoke(msg("what colour is it")).content == "two"                # same image, other question
    other = base64.b64encode(b"another image entirely").decode()
    assert llm.invoke(msg("what is in this image", other)).content == "three"   # other image


def test_an_image_prompts_text_is_filtered_part_by_part(lc_cache):
    """The text of a prompt looked up by its image is an exact filter; it was the digest of the parts joined by
    newlines, so parts "is it safe\nto eat", "raw?" and "is it safe", "to eat\nraw?" were one entry."""
    png = base64.b64encode(b"\x89PNG pretend image bytes").decode()
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}

    def msg(*texts):
        return [HumanMessage(content=[*({"type": "text", "text": t} for t in texts), image])]
    assert parse_prompt(dumps(msg("is it safe\nto eat", "raw?")))[0] == parse_prompt(dumps(msg("is it safe", "to eat\nraw?")))[0]
    llm = GenericFakeChatModel(messages=iter([AIMessage("first"), AIMessage("second")]), cache=lc_cache)
    assert llm.invoke(msg("is it safe\nto eat", "raw?")).content == "first"
    assert llm.invoke(msg("is it safe", "to eat\nraw?")).content == "second"
    assert llm.invoke(msg("is it safe\nto eat", "raw?")).content == "first"    # the same parts: a hit


def test_async_lookup_and_update(lc_cache):
    llm = FakeListChatModel(responses=["async answer", "never"], cache=lc_cache)

    async def run():
        a = await llm.ainvoke("tell me about frogs")
        b = await llm.ainvoke("tell me about frogs")
        return a.content, b.content

    assert asyncio.run(run()) == ("async answer", "async answer")
    assert llm.i == 1
    lc_cache.clear()
    assert llm.invoke("tell me about frogs").content == "never"


def test_prompt_parsing_is_bounded():
    assert parse_prompt("plain llm prompt")[:3] == ("plain llm prompt", [], "")
    # a plain LLM's prompt that is a JSON array of records is its text, not messages (one with a number or an
    # object for its "id" raised TypeError / KeyError inside the LLM call)
    for prompt in ('[{"id": 7, "name": "frog"}]', '[{"id": {"k": 1}}]', '[{"id": [], "kwargs": {"content": "x"}}]',
                   "[]", "[" * 5000 + "]" * 5000):
        assert parse_prompt(prompt)[:3] == (prompt, [], "")
    assert decode_data_url("https://example.com/cat.png") is None
    assert decode_data_url("data:image/png;base64,!!!") is None
    assert decode_data_url("data:image/png;base64," + base64.b64encode(b"ok").decode()) == b"ok"


def test_what_the_adapter_cannot_read_is_not_cached_and_the_rest_of_each_message_keys_it(lc_cache):
    """An image that is not a data URL, a part of another type, or a second image the lookup does not see
    would let two prompts share an answer: such prompts are not cached; and the rest of each message (its
    class, name, tool calls) is an exact filter beside the text."""
    png = base64.b64encode(b"\x89PNG pretend image bytes").decode()
    part = lambda data: {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    remote = lambda url: [HumanMessage(content=[{"type": "text", "text": "what is this"},
                                                {"type": "image_url", "image_url": {"url": url}}])]
    answers = iter([AIMessage(f"answer {i}") for i in range(10)])
    llm = GenericFakeChatModel(messages=answers, cache=lc_cache)
    assert llm.invoke(remote("https://example.com/a.png")).content == "answer 0"
    assert llm.invoke(remote("https://example.com/b.png")).content == "answer 1"      # not a's answer
    assert parse_prompt('[{' + HUMAN + '"kwargs": {"content": [{"type": "input_audio"}]}}]')[2] is None
    # two images: the second is a filter, so a prompt sharing only the first is another entry
    two = lambda second: [HumanMessage(content=[{"type": "text", "text": "which is bigger"}, part(png), part(second)])]
    other = base64.b64encode(b"another image").decode()
    assert llm.invoke(two(other)).content == "answer 2"
    assert llm.invoke(two(other)).content == "answer 2"                                # a repeat hits
    assert llm.invoke(two(base64.b64encode(b"a third image").decode())).content == "answer 3"
    # the same text from a message of another name is another entry
    assert llm.invoke([HumanMessage("what is a frog", name="ann")]).content == "answer 4"
    assert llm.invoke([HumanMessage("what is a frog", name="ann")]).content == "answer 4"
    assert llm.invoke([HumanMessage("what is a frog", name="bob")]).content == "answer 5"


def test_the_shape_of_a_prompt_keys_it_where_an_image_stands_is_never_ignored():
    """Which messages hold text and which an image is an exact filter: a text-only prompt never gets an
    image prompt's answer (even with cross_modal on and the image's features those of the text), and an
    image moved to another message of the same conversation is another request."""
    def caption_featurize(modality, data):      # an image's features are those of its caption
        return featurize("text", data.decode() if modality == "image" else data)

    head = LSHHead({"image": DIM, "text": DIM}, bits=64, dim=48, aligned=True, seed=0)
    lc = USHashLangChainCache(SemanticCache(head, {"radius": 10, "payload_threshold": 0.85, "cross_modal": True}),
                              featurize=caption_featurize)
    url = "data:image/png;base64," + base64.b64encode(b"a green frog").decode()
    frog = {"type": "image_url", "image_url": {"url": url}}
    llm = GenericFakeChatModel(messages=iter([AIMessage(f"answer {i}") for i in range(6)]), cache=lc)
    assert llm.invoke([HumanMessage(content=[{"type": "text", "text": "describe this"}, frog])]).content == "answer 0"
    assert llm.invoke([HumanMessage("a green frog")]).content == "answer 1"
    assert llm.invoke([HumanMessage("a green frog")]).content == "answer 1"                 # a repeat hits
    first = [HumanMessage(content=[{"type": "text", "text": "what is this?"}, frog]), AIMessage("a frog"),
             HumanMessage("and its colour?")]
    last = [HumanMessage("what is this?"), AIMessage("a frog"),
            HumanMessage(content=[{"type": "text", "text": "and its colour?"}, frog])]
    assert llm.invoke(first).content == "answer 2"
    assert llm.invoke(last).content == "answer 3"
    assert llm.invoke(first).content == "answer 2" and llm.invoke(last).content == "answer 3"
    assert parse_prompt('[{' + HUMAN + '"kwargs": {"content": "a"}}]')[2] == parse_prompt(
        '[{' + HUMAN + '"kwargs": {"content": [{"type": "text", "text": "b"}]}}]')[2]                    # one text part each
    img = '{"type": "image_url", "image_url": {"url": "data:image/png;base64,%s", "detail": "%s"}}'
    png = base64.b64encode(b"pretend image bytes").decode()
    # an image's detail and media type are keyed as the proxy keys them (content_form)
    digests = {parse_prompt(('[{' + HUMAN + '"kwargs": {"content": [%s]}}]') % (img % (png, d)).replace("image/png", t))[2]
               for d in ("low", "high") for t in ("image/png", "image/jpeg")}
    assert len(digests) == 4 and None not in digests


def test_a_prompt_the_cache_cannot_key_is_a_miss_and_not_stored(lc_cache):
    """A text over the encoder's window (or its length limit) is the cache's RequestError: to LangChain a miss
    whose answer is not stored, not an error in the model call."""
    from ushash.serving.cache import RequestError

    def refuse(*a, **k):
        raise RequestError("text of 300 tokens is over the text encoder's window of 256")

    lc_cache.featurize = None
    lc_cache.cache.query = refuse   # as the export's encoder refuses it
    llm = FakeListChatModel(responses=["first", "second"], cache=lc_cache)
    assert [llm.invoke("a very long prompt").content for _ in range(2)] == ["first", "second"]
    assert len(lc_cache.cache) == 0


def test_a_text_prompts_earlier_turns_are_matched_exactly(lc_cache):
    """A text prompt was looked up by all its messages' texts together, by meaning: two prompts whose system
    messages say opposite things in the same words ("answer in french not english", "answer in english not
    french") before one question were one entry. The texts of every message but the last are an exact filter;
    the last is still matched by meaning."""
    from langchain_core.messages import SystemMessage

    llm = FakeListChatModel(responses=["une grenouille", "a frog", "third"], cache=lc_cache)
    french = [SystemMessage("answer in french not english"), HumanMessage("what is a frog")]
    english = [SystemMessage("answer in english not french"), HumanMessage("what is a frog")]
    assert featurize("text", parse_prompt(dumps(french))[0]).tolist() == \
        featurize("text", parse_prompt(dumps(english))[0]).tolist()                  # alike by meaning
    assert llm.invoke(french).content == "une grenouille"
    assert llm.invoke(english).content == "a frog"                                   # not the French answer
    assert llm.invoke([french[0], HumanMessage("what is a frog?")]).content == "une grenouille"   # near: served
    assert llm.invoke(english).content == "a frog" and llm.i == 2
    assert parse_prompt(dumps([HumanMessage("what is a frog")]))[4] == ""             # one message: no context
