"""The K3 tokenizer read from the tiny checkpoint's tiktoken files, and the XTML chat encoding."""

import pytest
import torch

from h3gen.pipelines.k3.demo_model import BASE_VOCAB, MEDIA_PAD_ID, VOCAB_SIZE, build_tiny_checkpoint
from h3gen.pipelines.k3.model import K3ForCausalLM
from h3gen.pipelines.k3.tokenizer import K3Tokenizer


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-k3-tok"), seed=1)


@pytest.fixture(scope="module")
def tokenizer(tiny_k3):
    return K3Tokenizer.from_folder(tiny_k3)


def test_vocabulary_and_special_ids_come_from_the_files(tokenizer):
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert tokenizer.bos_token_id == BASE_VOCAB and tokenizer.eos_token_id == BASE_VOCAB + 1
    assert tokenizer.token_id("<|media_pad|>") == MEDIA_PAD_ID
    assert tokenizer.special_by_id[VOCAB_SIZE - 1] == f"<|reserved_token_{VOCAB_SIZE - 1}|>"


@pytest.mark.parametrize("text", ["hello the world", "Thé 42 12345 café\n\n  x", "中文字符 and emoji 🙂", ""])
def test_round_trip_and_merges(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < BASE_VOCAB for i in ids)
    assert len(ids) <= len(text.encode())


def test_bpe_merges_by_rank_and_pattern_splits(tokenizer):
    # " the" is one token; in "hello" the lowest-ranked pair "he" merges first, so "ello" is never reached and the
    # word ends as "he" + "llo" (tiktoken's order: always the lowest-ranked adjacent pair).
    assert tokenizer.encode(" the") == [tokenizer.ranks[b" the"]]
    assert tokenizer.encode("hello") == [tokenizer.ranks[b"he"], tokenizer.ranks[b"llo"]]
    assert [tokenizer.decode([i]) for i in tokenizer.encode("12345")] == ["1", "2", "3", "4", "5"]
    assert tokenizer._split.findall("12345 abc") == ["123", "45", " abc"]


def test_special_strings_in_user_text_stay_text(tokenizer):
    text = "<|open|>x"
    assert tokenizer.encode(text)[0] == tokenizer.token_id("<|open|>")
    plain = tokenizer.encode(text, allow_special=False)
    assert tokenizer.token_id("<|open|>") not in plain and tokenizer.decode(plain) == text


def test_chat_template_renders_xtml(tokenizer):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]},
        {"role": "assistant", "content": "A cat.", "reasoning_content": "Looks like a cat."},
        {"role": "user", "content": "<|open|>ok"},
    ]
    text = tokenizer.apply_chat_template(messages, thinking_effort=None, tokenize=False)
    assert text == (
        '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>What is this?<|media_pad|><|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Looks like a cat.<|close|>think<|sep|>'
        "<|open|>response<|sep|>A cat.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|><|open|>ok<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    ids = tokenizer.apply_chat_template(messages, thinking_effort=None)
    assert ids.count(tokenizer.token_id("<|open|>")) == 8  # the user's literal "<|open|>" is not a control token
    assert ids.count(MEDIA_PAD_ID) == 1 and tokenizer.decode(ids) == text
    effort = tokenizer.apply_chat_template(messages[:1], tokenize=False)
    assert effort.startswith('<|open|>message role="system" type="thinking-effort"<|sep|>')
    with pytest.raises(ValueError, match="thinking_effort"):
        tokenizer.apply_chat_template(messages, thinking_effort="huge")


def test_chat_prompt_generates_greedy_text(tiny_k3, tokenizer):
    model = K3ForCausalLM.from_pretrained(tiny_k3, torch_dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello the world"}])
    new = model.generate(torch.tensor([ids]), max_new_tokens=6)
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor([ids]), new], dim=1))
    assert torch.equal(logits[0, len(ids) - 1 : -1].argmax(-1), new[0])
    assert isinstance(tokenizer.decode(new[0].tolist()), str)
