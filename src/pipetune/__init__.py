import logging

# torchao (model.quantize; PEFT imports it whenever it is installed) logs at import when its optional CUDA
# kernels do not match the local torch build, and torch >= 2.13 warns about its pytree registrations.
# pipetune uses neither the kernels nor those registrations.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
