"""The model: shapes and families, loading, LoRA, the pipeline stages, attention kernels and the loss."""

import torch

# A CPU build of torch (2.13, with OpenMP threads) computed the first vectorized transcendental function of a
# process wrongly now and then: the first `cos` of the rotary embedding was off by up to 2e-4 at positions >= 32
# in about one process in three on 2 cores, and exact once any such function had run before (even on one
# element), or with one thread. One call here, on one element, before any model runs, keeps every later one exact
# (tests/model/test_adapter.py compares a PEFT-loaded model with the pipeline's stages to 1e-5).
torch.cos(torch.zeros(1))
