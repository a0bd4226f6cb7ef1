"""OpenAI server: ``OpenAIServingCompletion.create_completion`` and
``OpenAIServingChat.create_chat_completion`` are wrapped so that a bad ``vllm_xargs["xmix"]`` is
answered with an HTTP 400 before the server starts answering
(:func:`vllm_xmix.validation.http_precheck`), also for streaming requests."""

from __future__ import annotations

import functools
import logging

from ..validation import http_precheck
from ..validation.http import _n_prompts
from .core import mark

logger = logging.getLogger("vllm.xmix")


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
            err = http_precheck(self, request, prompts(request))
            if err is not None:
                return self.create_error_response(err)
            return await orig(self, request, *args, **kwargs)

        return create

    mark("OpenAIServingCompletion.create_completion", OpenAIServingCompletion, "create_completion",
          lambda orig: wrap(orig, lambda r: _n_prompts(getattr(r, "prompt", None))))
    mark("OpenAIServingChat.create_chat_completion", OpenAIServingChat, "create_chat_completion",
          lambda orig: wrap(orig, lambda r: 1))
