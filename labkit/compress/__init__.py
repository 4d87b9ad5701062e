"""Model compression beyond quantization: knowledge distillation and pruning."""
