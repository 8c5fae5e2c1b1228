"""A model's chat template, rendered in the gateway exactly as vLLM renders it.

vLLM turns a chat request into a prompt with the Hugging Face tokenizer's
``apply_chat_template``: a sandboxed Jinja environment (``trim_blocks``, ``lstrip_blocks``,
loop controls, a ``{% generation %}`` tag), a ``tojson`` filter that does not escape
HTML, the globals ``raise_exception`` and ``strftime_now``, and the tokenizer's named
special tokens (``bos_token``, ``eos_token``, ...) as variables beside ``messages``,
``tools``, ``documents`` and ``add_generation_prompt``. Before that it parses the
request's messages into a "conversation": each text content becomes a string (parts
joined by newlines) when the template treats content as a string, or a list of
``{"type": "text", "text": ...}`` parts when the template loops over it.

:func:`conversation` rebuilds that conversation for the requests the gateway can render
with certainty (string or text-part content; system, user and assistant roles; an
optional ``name``) and returns None for everything else (tools, images, tool calls,
reasoning fields, developer messages, continuing a final message): those are tokenized
by the engine's ``/tokenize`` instead. The gateway checks its renderings against the
engine on a sample of requests (llmgw/router/tokens.py); this module never guesses
silently.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Iterator, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

#: Roles whose messages are rendered locally; any other (tool, developer, function) is left
#: to the engine, which rewrites or annotates them.
ROLES = frozenset({"system", "user", "assistant"})
#: Message keys rendered locally; any other key (tool_calls, reasoning, ...) is left to the engine.
MESSAGE_KEYS = frozenset({"role", "content", "name"})
#: A system text that vLLM edits before rendering (it drops this attribution line).
EDITED_SYSTEM_PREFIX = "x-anthropic-billing-header"
#: Chat request fields that change the prompt in ways rendered only by the engine.
ENGINE_ONLY_FIELDS = ("tools", "documents", "continue_final_message", "reasoning_effort", "chat_template",
                      "add_special_tokens", "mm_processor_kwargs")
#: What apply_chat_template itself takes: named again in chat_template_kwargs, only the engine
#: knows which wins.
TEMPLATE_ARGUMENTS = frozenset({"tokenize", "chat_template", "messages", "conversation", "tools", "documents",
                                "add_generation_prompt", "continue_final_message"})
#: The named special tokens Hugging Face tokenizers hand every template, when the tokenizer has them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

STRING, OPENAI = "string", "openai"


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (the tracking the tag
    exists for matters only for training masks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


#: Every attribute a plain ``dict`` has (its methods and ``object``'s): any other name read
#: as an attribute of a dict is none, and the sandbox then reads it as a key.
_DICT_ATTRIBUTES = frozenset(dir(dict))


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox, with ``message.role`` on a plain dict read as the key at once.

    Jinja reads ``x.name`` by trying the attribute first and the key after it. A message is
    a dict, which has no such attribute: every ``message.role`` or ``message.content``
    raised and caught an ``AttributeError`` first, and that was half of a template's
    rendering (41 against 21 us for a 36-message conversation, bench/README.md). A name a
    dict does have (``items``, ``__class__``) goes the sandbox's way, so what a template
    sees, and what the sandbox refuses, are unchanged.
    """

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template.

    ``variables`` are the names the template reads from its caller (request-level
    ``chat_template_kwargs`` outside them are dropped, as vLLM drops them);
    ``content_format`` is :data:`STRING` or :data:`OPENAI`, detected as vLLM detects it
    (a loop over a message's content means parts). Raises jinja2.TemplateSyntaxError for a
    template that does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = _environment()
        ast = env.parse(source)
        self.source = source
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.content_format = OPENAI if _loops_over_content(ast) else STRING
        self.special_tokens = dict(special_tokens)
        self._template = env.from_string(source)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               kwargs: Mapping[str, Any] = {}) -> str:
        """Return the prompt text for ``messages`` (a :func:`conversation`).

        ``kwargs`` are the request's ``chat_template_kwargs``, already filtered to
        :attr:`variables`. Raises jinja2.TemplateError when the template refuses the
        conversation (``raise_exception``) or fails.
        """
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens, **kwargs})

    def conversation(self, body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """Return ``body``'s messages as vLLM hands them to this template, or None when the
        request needs the engine's own rendering (see the module docstring)."""
        if any(body.get(key) not in (None, False) for key in ENGINE_ONLY_FIELDS):
            return None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        out: list[dict[str, Any]] = []
        for message in messages:
            converted = self._message(message)
            if converted is None:
                return None
            out.append(converted)
        return out

    def template_kwargs(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Return the request's ``chat_template_kwargs`` this template reads ({} when none),
        or None when they are not a mapping or name one of :data:`TEMPLATE_ARGUMENTS`."""
        given = body.get("chat_template_kwargs")
        if given is None:
            return {}
        if not isinstance(given, dict) or not TEMPLATE_ARGUMENTS.isdisjoint(given):
            return None
        # vLLM drops unset values (None, "auto") before the template sees them.
        return {k: v for k, v in given.items() if k in self.variables and v is not None and v != "auto"}

    def _message(self, message: Any) -> dict[str, Any] | None:
        if not isinstance(message, dict) or not MESSAGE_KEYS.issuperset(message):
            return None
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return None
        texts = _texts(content)
        if texts is None or (role == "system" and any(t.startswith(EDITED_SYSTEM_PREFIX) for t in texts)):
            return None
        out: dict[str, Any] = {"role": role}
        if self.content_format == OPENAI:
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                return None
            out["name"] = name
        return out


def _texts(content: Any) -> list[str] | None:
    """Return the text pieces of a message's content (a string, or text parts), else None."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list) or not content:
        return None
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) - {"type", "text"}:
            return None
        text = part.get("text")
        if not isinstance(text, str):
            return None
        texts.append(text)
    return texts


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """Strip filters, tests and slices around an expression (``x['content'] | list``)."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _is_content(node: jinja2.nodes.Node) -> bool:
    node = _unwrap(node)
    if isinstance(node, jinja2.nodes.Name):
        return node.name == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return False


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """Return whether the template loops over a message's content (so content comes as parts)."""
    loops: Iterator[jinja2.nodes.For] = ast.find_all(jinja2.nodes.For)
    return any(_is_content(loop.iter) for loop in loops)
