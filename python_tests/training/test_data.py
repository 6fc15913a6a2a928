"""Training conversations: recovering a truncated ShareGPT array, turning turns into chat
messages, and the chat-template tokens with their assistant loss mask."""
import json

import pytest
import torch

from jakiro_ext.training.sharegpt import chat_tokens, iter_json_array, load_sharegpt, to_messages


def conv(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_truncated_array_yields_the_complete_objects(tmp_path):
    objs = [conv(("human", "hi"), ("gpt", "hello")), conv(("human", "2+2?"), ("gpt", "4"), ("human", "thanks"))]
    text = json.dumps(objs, indent=2)
    cut = text[:-1] + ',\n  {"id": "y", "conversations": [{"from": "human", "val'
    assert list(iter_json_array(cut)) == objs
    assert list(iter_json_array(text)) == objs
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    assert load_sharegpt(path) == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                                   [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]
    assert len(load_sharegpt(path, limit=1)) == 1
    with pytest.raises(ValueError, match=r"expected a JSON array"):
        list(iter_json_array('{"a": 1}'))


def test_turns_become_alternating_messages():
    assert to_messages(conv(("gpt", "stray"), ("human", "q"), ("gpt", "a"))) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    # A repeated role or an unknown one ends the conversation; a final question is dropped.
    assert to_messages(conv(("human", "q"), ("gpt", "a"), ("gpt", "b"))) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert to_messages(conv(("human", "q"), ("gpt", "a"), ("system", "s"), ("human", "q2"), ("gpt", "a2"))) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert to_messages(conv(("human", "q"))) == []
    assert to_messages(conv(("human", "q"), ("gpt", "  "))) == []


def test_chat_tokens_mask_the_assistant_turns():
    from transformers import AutoTokenizer

    from jakiro_ext.models.default import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green, then red."}]
    ids, mask = chat_tokens(tok, messages)
    full = tok.apply_chat_template(messages, tokenize=True)
    assert ids.tolist() == list(full["input_ids"] if hasattr(full, "keys") else full)
    assert mask.shape == ids.shape and mask.dtype == torch.bool
    runs, start = [], None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append(tok.decode(ids[start:i]))
            start = None
    assert [r.split("<|im_end|>")[0] for r in runs] == ["Blue.", "Green, then red."]
    assert all(r.startswith(("Blue", "Green")) and "<|im_end|>" in r for r in runs)
    cut_ids, cut_mask = chat_tokens(tok, messages, max_tokens=20)
    assert cut_ids.tolist() == ids[:20].tolist() and cut_mask.tolist() == mask[:20].tolist()


def test_chat_tokens_refuse_a_template_that_does_not_extend():
    class Rewriting:  # a template whose tokens for a longer conversation do not extend the shorter one's
        def apply_chat_template(self, msgs, add_generation_prompt=False, tokenize=True):
            return [len(msgs)] * (2 * len(msgs) + int(add_generation_prompt))

    with pytest.raises(ValueError, match=r"does not extend a conversation's tokens turn by turn"):
        chat_tokens(Rewriting(), [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
