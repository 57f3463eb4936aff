"""glmq: streaming FP8 -> group-wise INT4 conversion for GLM / DeepSeek-style MoE checkpoints."""

__version__ = "0.1.0"
