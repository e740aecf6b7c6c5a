"""``NativeTokenizer``: a model directory's tokenizer and chat template without transformers.

Encoding and decoding run on the ``tokenizers`` Rust library over
``tokenizer.json``; special tokens come from ``tokenizer_config.json``; the chat
template (``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``)
renders with ``jinja2`` in a sandbox set up the way transformers sets it up
(trim/lstrip blocks, ``loopcontrols``, ``tojson``, ``raise_exception``,
``strftime_now``). The surface is the part of transformers' tokenizer the engine
and server use: ``tok(text)["input_ids"]``, ``encode``, ``decode``, ``len(tok)``,
``apply_chat_template``, ``chat_template``, ``eos_token_id`` and friends.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tensorstream.errors import ConfigError

__all__ = ["NativeTokenizer", "can_load_native"]

_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


def can_load_native(directory: str | os.PathLike[str]) -> bool:
    """True when ``directory`` holds a ``tokenizer.json`` (the native tokenizer's input)."""
    return (Path(directory) / "tokenizer.json").is_file()


def _content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class NativeTokenizer:
    """Tokenizer of one model directory.

    Args:
        directory: holds ``tokenizer.json`` and usually ``tokenizer_config.json``.

    Raises:
        ConfigError: ``tokenizers``/``jinja2`` missing, or unreadable tokenizer files.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ConfigError(
                "the native tokenizer needs the 'tokenizers' package; run: pip install tokenizers"
            ) from exc
        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises plain Exceptions
            raise ConfigError(f"cannot read {path}: {exc}; check the tokenizer files") from exc
        config = self._read_json("tokenizer_config.json")
        self.init_kwargs = config
        self.special_tokens: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            value = _content(config.get(name))
            if value is not None:
                self.special_tokens[name] = value
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        template = config.get("chat_template")
        jinja_file = self.directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._special_ids = {
            i
            for i, token in self._tok.get_added_tokens_decoder().items()
            if getattr(token, "special", False)
        }
        self._compiled: dict[str, Any] = {}

    def _read_json(self, name: str) -> dict[str, Any]:
        path = self.directory / name
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ConfigError(f"cannot parse {path}: {exc}; fix or remove the file") from exc
        return data if isinstance(data, dict) else {}

    # -- special tokens -----------------------------------------------------------------

    def _id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._tok.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    @property
    def all_special_ids(self) -> list[int]:
        ids = {self._tok.token_to_id(t) for t in self.special_tokens.values()}
        return sorted(i for i in ids | self._special_ids if i is not None)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    # -- encode / decode ----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(
        self, text: str | Sequence[str], add_special_tokens: bool = True, **_: Any
    ) -> dict[str, Any]:
        """``{"input_ids": ..., "attention_mask": ...}`` for one text or a list of them."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        batch = [
            e.ids for e in self._tok.encode_batch(list(text), add_special_tokens=add_special_tokens)
        ]
        return {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}

    def decode(
        self,
        token_ids: int | Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **_: Any,
    ) -> str:
        """Text of ``token_ids``."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        clean = (
            self.clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is None
            else clean_up_tokenization_spaces
        )
        return _clean_up(text) if clean else text

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kwargs: Any) -> list[str]:
        return [self.decode(s, **kwargs) for s in sequences]

    # -- chat ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``conversation`` with the chat template (and tokenize unless ``tokenize=False``).

        Raises:
            ConfigError: no template given and the tokenizer has none.
        """
        template = chat_template or self.chat_template
        if template is None:
            raise ConfigError(
                f"the tokenizer in {self.directory} has no chat template; pass chat_template="
            )
        compiled = self._compiled.get(template)
        if compiled is None:
            compiled = self._compiled[template] = _compile(template)
        text = compiled.render(
            messages=[dict(m) for m in conversation],
            tools=list(tools) if tools is not None else None,
            documents=list(documents) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **kwargs,
        )
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False)


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization``: drop spaces before punctuation and contractions."""
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text


def _compile(template: str) -> Any:
    """A sandboxed jinja2 template with the globals and filters chat templates expect."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:
        raise ConfigError("chat templates need jinja2; run: pip install jinja2") from exc

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Generation(jinja2.ext.Extension):
        # ``{% generation %}...{% endgeneration %}`` marks assistant text for training
        # masks; rendering only needs its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not parse: {exc} (line {exc.lineno})") from exc
