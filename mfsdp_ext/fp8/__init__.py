"""FP8: the quantized tensor (tensor), the FP8 Linear and its autograd function (linear), and the parameter group
whose model weights are FP8 (group)."""
