"""The NF4 codebook: the one table of 4-bit NormalFloat levels every part of labkit reads.

NF4's 16 levels are quantiles of a standard normal rescaled to [-1, 1] with an exact 0 (QLoRA,
Dettmers et al. 2023, appendix E), index = the 4-bit code, as bitsandbytes ships them. It lives
here, without Triton, because both the dequant kernel (``kernels/nf4.py``) and the layers above
the kernels (``labkit.quant.nf4`` quantizes with it, the exercises check against it) need it, and
the kernels sit below labkit.quant (tests/test_layering.py).
"""

NF4_LEVELS: tuple[float, ...] = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
