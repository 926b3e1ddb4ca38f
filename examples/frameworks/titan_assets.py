"""The local assets the torchtitan example reads, generated here (nothing is downloaded): a small byte-level BPE
tokenizer (vocab 2000, under the debug models' 2048) and an English-like corpus, in the layouts torchtitan reads:

    DIR/tokenizer/{tokenizer.json, tokenizer_config.json}   (torchtitan's HuggingFaceTokenizer: hf_assets_path)
    DIR/c4_test/data.json                                   (JSON lines {"text": ...}: the "c4_test" dataset's path)

    python examples/frameworks/titan_assets.py [DIR [DOCS]]  (default: examples/frameworks/assets, 1500 documents;
                                                             about 1 s)

Deterministic: the same files on every machine. torchtitan_train.py makes them itself when they are missing.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(HERE, "assets")
VOCAB = 2000
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there would their we him been has when who will more no if out so said what up its "
         "about into than them can only other new some could time these two may then do first any my now such like "
         "our over man me even most made after also did many before must through back years where much your way "
         "well down should because each just those people how too little state good very make world still own see "
         "men work long get here between both life being under never day same another know while last might us "
         "great old year off come since against go came right used take three model shard gradient tensor rank "
         "memory optimizer step loss layer weight train batch token sequence attention embedding norm head expert "
         "router parallel data pipeline checkpoint resume reduce gather scatter device kernel stream buffer").split()


def corpus(n_docs: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n_docs):
        sents = []
        for _ in range(rng.randint(3, 12)):
            n = rng.randint(5, 18)
            words = [rng.choice(WORDS) for _ in range(n)]
            if rng.random() < 0.2:
                words.insert(rng.randrange(n), str(rng.randint(0, 9999)))
            sents.append(" ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!"]))
        yield {"text": " ".join(sents)}


def make_assets(out_dir: str = DEFAULT_DIR, n_docs: int = 1500, writer: bool = True) -> str:
    """Write the tokenizer and corpus under ``out_dir`` (if not there yet); returns ``out_dir``. ``writer=False``
    (the other ranks of a machine): wait until they are there."""
    tok_dir, data_dir = os.path.join(out_dir, "tokenizer"), os.path.join(out_dir, "c4_test")
    done = os.path.join(tok_dir, "tokenizer_config.json")  # written last
    if not writer:
        for _ in range(1200):
            if os.path.exists(done):
                return out_dir
            time.sleep(0.1)
        raise TimeoutError(f"{done} did not appear (local rank 0 writes it)")
    if os.path.exists(done):
        return out_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    docs = list(corpus(n_docs))
    tmp = os.path.join(data_dir, f"data.json.{os.getpid()}")
    with open(tmp, "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((d["text"] for d in docs), trainer=trainer)
    tok.save(os.path.join(tok_dir, f"tokenizer.json.{os.getpid()}"))
    cfg = {
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True, "normalized": False,
                                                           "lstrip": False, "rstrip": False, "single_word": False}
                                 for t in (BOS, EOS)},
    }
    with open(os.path.join(tok_dir, f"tokenizer_config.json.{os.getpid()}"), "w") as f:
        json.dump(cfg, f, indent=2)
    # each file appears whole (ranks of one machine may write them at the same time: the same bytes)
    os.replace(tmp, os.path.join(data_dir, "data.json"))
    os.replace(os.path.join(tok_dir, f"tokenizer.json.{os.getpid()}"), os.path.join(tok_dir, "tokenizer.json"))
    os.replace(os.path.join(tok_dir, f"tokenizer_config.json.{os.getpid()}"),
               os.path.join(tok_dir, "tokenizer_config.json"))
    return out_dir


if __name__ == "__main__":
    print(make_assets(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR,
                      n_docs=int(sys.argv[2]) if len(sys.argv) > 2 else 1500))
