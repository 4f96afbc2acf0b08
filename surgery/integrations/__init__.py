"""surgery beside other libraries: those that change a model's forward (TRL's fused head) and those
whose kernels it runs (flash-linear-attention). Each module says the releases it was checked on."""
