"""The tiny demo tokenizer: a byte-level BPE trained on the synthetic meetings, cached on disk.

It lets the built-in tiny model train and run with no hub access. Training is deterministic and
happens once per cache directory; processes that start at the same time each build into a private
directory and rename it into place, so exactly one copy wins and the others load it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pipetune.config import SYSTEM_PROMPT
from pipetune.data.synthetic_splits import synthetic_splits
from pipetune.files import default_cache_dir, write_atomic_dir

TOKENIZER_VERSION = 1
"""Part of the cache directory name; bump it whenever the training recipe below changes."""
DEFAULT_VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Trained first, so they get ids 0, 1 and 2."""
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MODEL_MAX_LENGTH = 1_000_000
"""No practical limit: the model config and ``data.max_length`` bound sequence length instead."""


def tokenizer_dir(cache_dir: str | os.PathLike | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Where ``demo_tokenizer(cache_dir, vocab_size)`` keeps its files."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"tiny-qwen3-v{TOKENIZER_VERSION}"
    if vocab_size != DEFAULT_VOCAB_SIZE:
        name += f"-vocab{vocab_size}"
    return root / "tokenizers" / name


def training_texts() -> list[str]:
    """Everything the tokenizer is trained on: the synthetic meetings, the system prompt and "[...]"."""
    texts = [SYSTEM_PROMPT, "[...]"]
    for meetings in synthetic_splits(seed=0).values():
        for meeting in meetings:
            texts += [meeting.transcript, meeting.summary]
    return texts


def _train(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(), trainer=trainer)
    return tokenizer


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # keep decode(encode(text)) == text
    )


def _build_into(target: Path, vocab_size: int) -> None:
    """Train and save into ``target``, whole (unless another process's build got there first)."""
    try:
        write_atomic_dir(target, lambda staging: _wrap(_train(vocab_size)).save_pretrained(staging), "tokenizer.json")
    except OSError as e:  # a write to an open file names none: the tokenizer's directory is the one that failed
        raise OSError(e.errno, e.strerror, e.filename or str(target)) from None
    except Exception as e:  # the tokenizers library's own writes fail as a plain Exception ("... (os error 28)")
        if f"(os error {errno.ENOSPC})" not in str(e):
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target)) from None


def demo_tokenizer(
    cache_dir: str | os.PathLike | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """The demo tokenizer: trained into ``tokenizer_dir(cache_dir, vocab_size)`` once, loaded after."""
    n_reserved = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size <= n_reserved:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for merges: the 256 byte symbols and "
            f"{len(SPECIAL_TOKENS)} special tokens take {n_reserved}; use at least {n_reserved + 1}"
        )
    target = tokenizer_dir(cache_dir, vocab_size)
    if not target.exists():
        _build_into(target, vocab_size)
    if not (target / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{target} exists but holds no tokenizer.json (an interrupted copy?); delete it and call again"
        )
    return PreTrainedTokenizerFast.from_pretrained(target)
