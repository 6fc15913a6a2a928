"""A training run on a tiny target, for test_train_distributed.py: run alone, or under torchrun
(``python -m torch.distributed.run --nproc-per-node N ddp_train_worker.py OUT [CHECKPOINT]``),
rank 0 writes the history and the trained weights to OUT (a directory). With CHECKPOINT, the
checkpoint of step SNAPSHOT_STEP is copied to OUT/snapshot.pt as the run passes it."""
import json
import shutil
import sys
from pathlib import Path

import torch

from jakiro_ext.models.heads.config import DraftConfig
from jakiro_ext.models.heads.draft_head import DraftHead
from jakiro_ext.training.settings import TrainConfig
from jakiro_ext.training.distributed import init_distributed
from jakiro_ext.training.examples import make_example
from jakiro_ext.training.train import train_head
from helpers import prompt, tiny_target

SNAPSHOT_STEP = 3
# fp32 products: the test compares one process with two to float rounding, which bf16 would swamp
CONFIG = TrainConfig(steps=6, lr=3e-3, warmup_steps=2, batch_sequences=4, checkpoint_every=1, eval_every=3,
                     ttt_steps=1, compute_dtype="float32")


def setup(kind: str = "jakiro"):
    """The target, a fresh head and the training and held-out examples (deterministic)."""
    target = tiny_target()
    examples = []
    for k in range(11):  # ragged: 6-token prompts with 9 to 27 learned tokens
        x = prompt(6 + 3 * (k % 7), seed=70 + k)
        examples.append(make_example(target, x, torch.arange(x.numel()) >= 6))
    head = DraftHead(DraftConfig.for_target(target.config, kind, num_experts=4, intermediate_size=32))
    # 9 training sequences in batches of 4: each epoch's last batch has one, and leaves a process idle.
    return target, head.init_weights(0).bind(target), examples[:9], examples[9:]


def main(out: str, checkpoint: str = None):
    ranks = init_distributed()
    _, head, train, held_out = setup()
    out = Path(out)

    def snapshot(step, record, planned):  # (rank 0) the checkpoint of SNAPSHOT_STEP is on disk by the next step
        if checkpoint and step == SNAPSHOT_STEP:
            shutil.copy(checkpoint, out / "snapshot.pt")
    history = train_head(head, train, CONFIG, held_out, checkpoint=checkpoint, on_step=snapshot, ranks=ranks)
    (out / f"rank-{ranks.rank}-of-{ranks.world}").write_text(f"{len(history)} steps\n")  # who took part
    if ranks.rank == 0:
        (out / "history.json").write_text(json.dumps(history))
        torch.save(head.state_dict(), out / "head.pt")
    ranks.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
