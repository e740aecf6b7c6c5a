"""The native tokenizer and chat template equal transformers' AutoTokenizer on SmolLM2's files."""

from __future__ import annotations

import random

import pytest

from tensorstream.engine.tokenizer import NativeTokenizer
from tensorstream.errors import ConfigError

_PIECES = [
    "Hello", " world", "!", "The quick brown fox", " jumps over", "  two  spaces", "\n", "\n\n",
    "\t tab", "naïve café", "日本語のテキスト", "中文", "Ελληνικά", "русский текст", "emoji 🙂🚀",
    "👩‍👩‍👧", "مرحبا", "עברית", "x" * 40, "12345", "3.14159", " don't", " I'm", " can't .",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n", "<repo_name>",
    "a<|im_end|>b", "  <|im_start|>  ", "```python\nprint('hi')\n```", "{\"json\": [1, 2]}",
    "\u00a0nbsp", "\u200bzero-width", "ﬁ ligature", "Ⅻ", "e\u0301", "\r\n", "   ",
]  # fmt: skip


def _corpus(count: int = 300) -> list[str]:
    rng = random.Random(13)
    texts = list(_PIECES)
    while len(texts) < count:
        texts.append("".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 6))))
    return texts


def _chats(count: int = 60) -> list[list[dict[str, str]]]:
    rng = random.Random(7)
    texts = _corpus()
    chats = []
    for i in range(count):
        turns = []
        if i % 3 == 0:
            turns.append({"role": "system", "content": rng.choice(texts)})
        for t in range(rng.randint(1, 4)):
            turns.append(
                {"role": "user" if t % 2 == 0 else "assistant", "content": rng.choice(texts)}
            )
        chats.append(turns)
    return chats


@pytest.fixture(scope="module")
def pair(smollm2_dir):
    import transformers

    return NativeTokenizer(smollm2_dir), transformers.AutoTokenizer.from_pretrained(smollm2_dir)


def test_encode_equals_transformers(pair):
    ours, theirs = pair
    for text in _corpus():
        for special in (True, False):
            assert (
                ours(text, add_special_tokens=special)["input_ids"]
                == (theirs(text, add_special_tokens=special)["input_ids"])
            ), text
    batch = _corpus()[:20]
    assert ours(batch)["input_ids"] == theirs(batch)["input_ids"]


def test_decode_equals_transformers(pair):
    ours, theirs = pair
    for text in _corpus():
        ids = theirs(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            ), text
    for token in (0, 1, 2, 17, 49151):  # single tokens, as the engine decodes logprobs
        assert ours.decode([token]) == theirs.decode([token])


def test_special_tokens_and_vocab_equal_transformers(pair):
    ours, theirs = pair
    assert len(ours) == len(theirs)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "eos_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert set(ours.all_special_ids) >= set(theirs.all_special_ids)
    assert ours.convert_ids_to_tokens([1, 2, 300]) == theirs.convert_ids_to_tokens([1, 2, 300])


def test_chat_template_equals_transformers(pair):
    ours, theirs = pair
    assert ours.chat_template == theirs.chat_template
    for chat in _chats():
        for generation in (True, False):
            expected = theirs.apply_chat_template(
                chat, add_generation_prompt=generation, tokenize=False
            )
            assert (
                ours.apply_chat_template(chat, add_generation_prompt=generation, tokenize=False)
                == expected
            )
            assert ours.apply_chat_template(chat, add_generation_prompt=generation) == list(
                theirs(expected, add_special_tokens=False)["input_ids"]
            )


def test_custom_template_features(pair):
    """Globals and filters chat templates use: tojson, raise_exception, namespace, loop controls."""
    ours, theirs = pair
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{{ m | tojson }}{% generation %}|{% endgeneration %}"
        "{% endfor %}{{ ns.n }}{{ bos_token }}{{ eos_token }}"
    )
    chat = [{"role": "user", "content": 'é "q" <b>'}, {"role": "skip", "content": "x"}]
    expected = theirs.apply_chat_template(chat, chat_template=template, tokenize=False)
    assert ours.apply_chat_template(chat, chat_template=template, tokenize=False) == expected
    failing = "{{ raise_exception('no system role') }}"
    with pytest.raises(Exception, match="no system role"):
        ours.apply_chat_template(chat, chat_template=failing)
    with pytest.raises(ConfigError, match="does not parse"):
        ours.apply_chat_template(chat, chat_template="{% for %}")


def test_unreadable_tokenizer_file_is_a_config_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        NativeTokenizer(tmp_path)
