"""OpenAI server: ``OpenAIServingCompletion.create_completion`` and
``OpenAIServingChat.create_chat_completion`` are wrapped so that a bad selection (``mi_apps`` or
``vllm_xargs["xmix"]``) is answered with an HTTP 400 before the server starts answering
(:func:`vllm_xmix.validation.http_selection_check`), also for streaming requests, and so that responses
carry read values in a ``mi_results`` field: non-streaming responses at the top level (the values
of ``RequestOutput.mi_results`` as JSON, also kept in ``kv_transfer_params["xmix_results"]``);
streamed chunks in their choice, the values of the positions new in that chunk
(:class:`vllm_xmix.results.StreamDelta`), and the final chunk's choice also
``mi_results_complete``, all of them (the non-streaming response's ``mi_results``). A streamed
request that selects no app, or only apps without reads (steering, ablation), gets vLLM's own
stream generator, unwrapped: its chunks never carry values, and a wrapper would cost every
chunk two more generator hops on the server's event loop."""

from __future__ import annotations

import contextvars
import functools
import json
import logging

import msgspec

from ..results import StreamDelta
from ..spec import CONFIG_KEY
from ..validation.http import _n_prompts, error_param, http_selection_check, parse_json
from .core import mark

logger = logging.getLogger("vllm.xmix")

#: whether the request being answered (in this task) may get read values in its responses, set
#: by the request handler for the stream generator it creates; True where unknown (wrap)
_MAY_READ: contextvars.ContextVar[bool] = contextvars.ContextVar("xmix_may_read", default=True)


def patch_openai_server() -> None:
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except Exception as e:  # the server is optional
        logger.debug("vllm_xmix: OpenAI server not importable (%s)", e)
        return

    def wrap(orig, prompts):
        @functools.wraps(orig)
        async def create(self, request, *args, **kwargs):
            err, may_read = http_selection_check(self, request, prompts(request))
            if err is not None:  # the OpenAI error body's param: the field the message names
                return self.create_error_response(err, param=error_param(err))
            token = _MAY_READ.set(may_read)  # (read by wrap_stream, when orig creates the stream)
            try:
                resp = await orig(self, request, *args, **kwargs)
            finally:
                _MAY_READ.reset(token)
            kv = getattr(resp, "kv_transfer_params", None)
            if isinstance(kv, dict) and "xmix_results" in kv:
                resp.mi_results = kv["xmix_results"]  # (an extra field: vLLM's response models allow them)
            return resp

        return create

    def wrap_stream(orig, gen_index):
        @functools.wraps(orig)
        def stream(self, request, *args, **kwargs):
            """vLLM's stream generator itself for a request that selects no app or only apps
            without reads, else :func:`stream_with_reads` around it."""
            if CONFIG_KEY not in (getattr(request, "vllm_xargs", None) or {}) or not _MAY_READ.get():
                return orig(self, request, *args, **kwargs)
            return stream_with_reads(orig, gen_index, self, request, args, kwargs)

        return stream

    async def stream_with_reads(orig, gen_index, self, request, args, kwargs):
        """The chunks of ``orig``'s stream, each with the read values of the positions it adds.
        This runs for every streamed token of a request with reads, on the server's event loop:
        a decode step's chunk costs the loop below and :func:`_splice_step`."""
        args = list(args)
        latest = [None]  # what the result generator gave last: a RequestOutput, or (prompt index, output)

        async def outputs(gen):
            async for item in gen:
                latest[0] = item
                yield item

        if len(args) > gen_index:
            args[gen_index] = outputs(args[gen_index])
        else:
            kwargs["result_generator"] = outputs(kwargs["result_generator"])
        deltas: dict[int, StreamDelta] = {}
        first = None  # deltas[0], once the first chunk made it
        async for chunk in orig(self, request, *args, **kwargs):
            res = latest[0]
            if res is not None:
                if res.__class__ is tuple:
                    res = res[1]
                view = res._xmix_view
                if view is not None:
                    text = _splice_step(chunk, first, view) if first is not None else None
                    if text is not None:
                        chunk = text
                    elif chunk.startswith("data: {"):  # (the splice's checks have run once already)
                        chunk = (_with_reads_parsed if first is not None else _with_reads)(chunk, view, deltas)
                        first = deltas.get(0)
            yield chunk

    mark("OpenAIServingCompletion.create_completion", OpenAIServingCompletion, "create_completion",
          lambda orig: wrap(orig, lambda r: _n_prompts(getattr(r, "prompt", None))))
    mark("OpenAIServingChat.create_chat_completion", OpenAIServingChat, "create_chat_completion",
          lambda orig: wrap(orig, lambda r: 1))
    mark("OpenAIServingCompletion.completion_stream_generator", OpenAIServingCompletion,
         "completion_stream_generator", lambda orig: wrap_stream(orig, 1))
    mark("OpenAIServingChat.chat_completion_stream_generator", OpenAIServingChat,
         "chat_completion_stream_generator", lambda orig: wrap_stream(orig, 0))


#: where the (single) choice of a streamed chunk ends in vLLM's serialization of its stream
#: responses: before ``usage`` when it is set (a JSON string cannot contain this sequence, its
#: quote would be escaped, and no choice has a ``usage`` key of its own), else at the end of the
#: object (vLLM serializes chunks with ``exclude_unset=True``: ``..."choices":[{...}]}``)
_CHOICE_END = '}],"usage":'
_LAST_CHOICE_END = "}]}\n\n"
# msgspec writes the values in ~1 us where the json module takes ~6 (chunks are parsed with
# validation.http.parse_json, msgspec too): this runs for every streamed token of a request with
# reads, on the server's event loop, which is the bottleneck at saturation. Its output is compact
# JSON with non-finite floats as null (the values come as None there already:
# results._json_values).
_ENCODE = msgspec.json.Encoder()


#: the text of a chunk whose single choice (index 0) is not the last one of its stream, in vLLM's
#: serialization: each of these can only be JSON structure, never text inside a JSON string
#: (where every quote is escaped), so finding them needs no parse (a dict key can spell one:
#: ``_with_reads`` requires the finish reason's to be the only one)
_ONE_CHOICE = '"choices":[{"index":0,'
_NOT_FINAL = '"finish_reason":null'


def _splice_step(chunk: str, d: StreamDelta, view) -> str | None:
    """``chunk`` with its choice's ``mi_results`` spliced in without a parse, for the common case:
    a decode step's chunk (one probe value, or several when the stream merged outputs; see
    :meth:`vllm_xmix.results.StreamDelta.take_text`) whose single choice (index 0) is not the last
    one of its stream; None for any other chunk (then :func:`_with_reads`). ``d``: the stream's
    :class:`StreamDelta` of choice 0; ``view``: the chunk's output's ``ResultsView``."""
    # (a dict key can hold the quotes a string cannot: a top logprob's token text "finish_reason"
    # with a NaN logprob writes '"finish_reason":null' too, so the choice's own must be the only one)
    if (_ONE_CHOICE in chunk and _NOT_FINAL in chunk and '},{"index":' not in chunk and '"role":' not in chunk
            and chunk.count('"finish_reason":') == 1):
        at = chunk.find(_CHOICE_END)
        if at < 0:
            # without usage: the choices array must end the object and be its only array of
            # objects (the id, object, created and model fields come before it; a string's
            # escaped quote can spell '":[{' too, which only sends the chunk the parsed way)
            if chunk[-5:] != _LAST_CHOICE_END or chunk.count('":[{') != 1:
                return None
            at = -5
        text = d.take_text(view[0], view[1])
        if text is not None:
            return f'{chunk[:at]},"mi_results":{text}{chunk[at:]}'
    return None


def _with_reads(chunk: str, view, deltas: dict) -> str:
    """A streamed ``data: {...}`` chunk with its choice's ``mi_results`` (and, with the finish
    reason, ``mi_results_complete``). The values are spliced into the chunk's text at the end of
    its choice (the chunk is parsed, not serialized again: this runs for every streamed token of
    every request with reads, on the server's event loop); a chunk of another shape is
    serialized again whole. A decode step's chunk with one probe value in a single-choice
    chunk that is not the last (the common case) is spliced without a parse
    (:func:`_splice_step`)."""
    d = deltas.get(0)
    if d is not None:
        text = _splice_step(chunk, d, view)
        if text is not None:
            return text
    return _with_reads_parsed(chunk, view, deltas)


def _choice_end(chunk: str, data: dict) -> int:
    """Where the single choice of ``chunk`` (``data``: the chunk parsed) ends in its text: the
    index of the choice object's closing brace, -1 where that is not certain. vLLM writes the
    top-level fields in ``data``'s order with no spaces, so the choices array ends in ``}]``
    followed by the next field's key (e.g. ``"usage"``, or ``"system_fingerprint"`` on a
    completion's final chunk) or by the object's end. The last ``}],"<that key>":`` in the text is
    that end (a JSON string cannot hold the quotes unescaped, and the fields after the choices
    hold no lists of objects)."""
    keys = list(data)
    i = keys.index("choices")
    if i == len(keys) - 1:
        return len(chunk) - len(_LAST_CHOICE_END) if chunk.endswith(_LAST_CHOICE_END) else -1
    return chunk.rfind(f'}}],"{keys[i + 1]}":')


def _with_reads_parsed(chunk: str, view, deltas: dict) -> str:
    """:func:`_with_reads` for a chunk :func:`_splice_step` does not take: parsed, the values of
    every choice it holds put in."""
    data = parse_json(chunk[len("data: "):])
    if not isinstance(data, dict):
        return chunk
    choices = data.get("choices") or []
    if not choices:
        return chunk
    c = choices[0]
    if (c.get("delta") or {}).get("role") is not None and c.get("finish_reason") is None:
        return chunk  # chat's opening chunk names the role and carries no token: values come with the tokens
    i = c.get("index", 0)
    d = deltas.get(i)
    if d is None:  # (not setdefault: that would build a StreamDelta for every chunk)
        d = deltas[i] = StreamDelta()
    extra = {"mi_results": d.take(view._acc, view._upto)}
    if c.get("finish_reason") is not None:
        n_gen = view._n_generated
        extra["mi_results_complete"] = view._acc.final_json(n_gen, view._upto)
    at = _choice_end(chunk, data) if len(choices) == 1 else -1
    if at > 0:
        fields = _ENCODE.encode(extra)[1:-1].decode()
        return f"{chunk[:at]},{fields}{chunk[at:]}"
    c.update(extra)
    return f"data: {json.dumps(data)}\n\n"
