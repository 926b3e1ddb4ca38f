"""What the main job, the benchmarks and the tests share: models and the glue around them. Not part of the training
API (nothing here is re-exported by ``mfsdp_ext``); it ships with the package so that examples, benchmarks and tests
import it by name (``from mfsdp_ext.testing import gpt``) instead of putting folders of the repository on sys.path.

  gpt.py     a GPT / Llama-style decoder and the glue that shards it with FSDP2 or mfsdp_ext (the main job's
             model: examples/train_gpt.py, examples/training.py, benchmarks/step.py and the other benchmarks)
  models.py  small models and a training loop for the distributed tests (run inside the rank processes)
"""
