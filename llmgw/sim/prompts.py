"""How the simulated engine turns prompts into token ids: its built-in word tokenizer
(llmgw/sim/tokenizer.py), or, with ``--tokenizer DIR``, a Hugging Face tokenizer and chat
template rendered as vLLM renders them (llmgw/hftokenizer.py), whose files it then also
serves at ``GET /llmgw/tokenizer`` as llmgw's vLLM guard does (``--served-tokenizer`` serves
another directory's: a gateway holding the wrong files).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from llmgw.hftokenizer import LocalTokenizer, read_tokenizer_files
from llmgw.sim import tokenizer as words


class PromptTokenizer:
    """Prompt token ids for the simulator. Raises ValueError (a 400) for a prompt it cannot
    tokenize; :class:`~llmgw.hftokenizer.TokenizerFilesError` or OSError at start for bad files."""

    def __init__(self, directory: str | None = None, served: str | None = None) -> None:
        self.hf = LocalTokenizer(read_tokenizer_files(directory)) if directory else None
        self.served_body = (
            json.dumps({"files": {k: v.decode("utf-8") for k, v in read_tokenizer_files(served).items()}}).encode()
            if served else None
        )

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        """Return the ids of a chat request's prompt (its chat template applied)."""
        add_generation_prompt = body.get("add_generation_prompt", True) is not False
        if self.hf is None:
            return words.encode_chat(body.get("messages"), add_generation_prompt=add_generation_prompt)
        parts = self.hf.chat_parts(body)
        if parts is None:
            raise ValueError("the simulator's --tokenizer renders only text messages of system, user and "
                             "assistant (no tools, images or engine-only fields)")
        return self.hf.ids(parts)

    def text(self, prompt: str) -> list[int]:
        """Return the ids of a completions prompt (special tokens added as vLLM adds them)."""
        if self.hf is None:
            return words.encode(prompt)
        return self.hf.ids(self.hf.completion_parts(prompt))
