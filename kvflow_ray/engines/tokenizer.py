"""Tokenizers for every engine and the ingress: byte-level (for random-weight models) or a local HF one.

Both share one small interface (`Tokenizer`): `encode` never adds special tokens by itself, since the chat template
already spells out whatever a model expects at the start; `decode` drops specials.

Chats with tools (`apply_chat_template(messages, tools=...)`, or a history holding tool calls and
results) render through the model's own template when it renders tools itself (its source names
`tools`), else through the fallback of `tool_calls.fallback_messages` (Hermes style, in the template's
own roles); ByteTokenizer always uses the fallback. Rendering is a pure function of its arguments.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvflow_ray.engines.tool_calls import fallback_messages, template_messages

ROLE_TAGS = ("system", "user", "assistant")


def format_chat(messages: list[dict[str, Any]]) -> str:
    """The role-tag chat format, used by ByteTokenizer and by HF tokenizers that ship no chat template.

    Each message becomes "<|role|>\\n{content}\\n"; the prompt ends with "<|assistant|>\\n" so the model continues as
    the assistant. Example: [system "Be brief.", user "Hi"] ->
    "<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\n".
    The tags are plain text (bytes for ByteTokenizer), not special ids, so they survive encode/decode unchanged.
    """
    parts = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role not in ROLE_TAGS:
            raise ValueError(f"unknown chat role {role!r}; expected one of {ROLE_TAGS}")
        parts.append(f"<|{role}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def has_tool_turns(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether a conversation holds tool calls or tool results (then it needs a tool-aware rendering)."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def template_renders_tools(template: object) -> bool:
    """Whether a Hugging Face chat template renders tools itself: its source reads the `tools` variable
    (a template that never names it would drop them). Named templates (a dict): the default one."""
    if isinstance(template, dict):
        template = template.get("default") or template.get("tool_use")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def piece(self, token: int) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: Sequence[dict[str, Any]] | None = None) -> str: ...


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes of the text; 256.. are specials. No training, no files, any text round-trips."""

    BOS, EOS, PAD, RESERVED = 256, 257, 258, 259  # RESERVED keeps the vocab at 260 for a future special
    vocab_size: int = 260
    bos_id: int | None = BOS
    eos_id: int | None = EOS
    pad_id: int | None = PAD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # A generated stream may stop mid-character, so broken UTF-8 becomes U+FFFD instead of raising.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def piece(self, token: int) -> str:
        """One token's text, specials included (a byte of a longer character is not text: empty)."""
        return bytes([token]).decode("utf-8", errors="ignore") if 0 <= token < 256 else ""

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: Sequence[dict[str, Any]] | None = None) -> str:
        if tools or has_tool_turns(messages):
            return format_chat(fallback_messages(messages, tools))
        return format_chat(messages)


class HFTokenizer:
    """A local HF tokenizer (`AutoTokenizer`, no network) behind the same interface."""

    def __init__(self, path: str) -> None:
        if not Path(path).is_dir():
            raise ValueError(f"tokenizer path {path!r} is not a local directory")
        from transformers import AutoTokenizer  # lazy: ByteTokenizer users need no transformers import

        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
        self._adopt(tok)

    @classmethod
    def wrap(cls, tok: Any) -> HFTokenizer:
        """An HF tokenizer someone already loaded (SGLang's TokenizerManager holds one), so the serving
        layer encodes, decodes and renders chats with exactly the tokenizer the engine uses."""
        self = cls.__new__(cls)
        self._adopt(tok)
        return self

    def _adopt(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size: int = len(tok)  # includes added tokens, unlike tok.vocab_size
        self.bos_id: int | None = tok.bos_token_id
        self.eos_id: int | None = tok.eos_token_id
        self.pad_id: int | None = tok.pad_token_id

    @property
    def renders_tools(self) -> bool:
        """Whether the model's own chat template renders tools (read each time: a template may be set later)."""
        return template_renders_tools(self.tok.chat_template)

    def encode(self, text: str) -> list[int]:
        # Specials written out in the text (e.g. a template's "<|begin_of_text|>") still map to their ids.
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def piece(self, token: int) -> str:
        """One token's text, specials included (a chat template's role markers are specials)."""
        return str(self.tok.decode([token], skip_special_tokens=False))

    @property
    def chat_template(self) -> str | None:
        template = self.tok.chat_template
        return template.get("default") if isinstance(template, dict) else template

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: Sequence[dict[str, Any]] | None = None) -> str:
        if tools or has_tool_turns(messages):
            if self.renders_tools:  # the model's own rendering of tools, calls and results
                return str(self.tok.apply_chat_template(template_messages(messages), tools=list(tools or []) or None,
                                                        tokenize=False, add_generation_prompt=True))
            messages = fallback_messages(messages, tools)
        if self.tok.chat_template is None:
            return format_chat(messages)
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """ByteTokenizer for random-weight models (path None), else the tokenizer stored with the model at `path`."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
