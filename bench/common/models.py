"""Model shapes the engine benchmarks run with random weights.

Speed does not depend on weight values, so the engine, serving, tp and
trace benchmarks build `pkvattn.models.DecoderConfig`s of real models'
shapes and initialise random bf16 weights (`pkvattn.models.init_params`).
"""

from __future__ import annotations

import dataclasses

from pkvattn import Llama3RopeScaling, RopeConfig
from pkvattn.models import DecoderConfig

# Llama 3.2 1B: 16 layers, hidden 2048, 32 / 8 heads of 64, vocab 128256,
# Llama 3 RoPE scaling.
LLAMA_3_2_1B = DecoderConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
    num_qo_heads=32, num_kv_heads=8, head_dim=64,
    rope=RopeConfig(theta=500000.0, scaling=Llama3RopeScaling(
        factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)),
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000,
    eos_token_ids=(128001,), max_position_embeddings=131072,
    model_type="llama")

# SmolLM2-135M-Instruct: 30 layers, hidden 576, 9 / 3 heads of 64, vocab
# 49152 (Llama architecture).
SMOLLM2_135M = DecoderConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_qo_heads=9, num_kv_heads=3, head_dim=64,
    rope=RopeConfig(theta=100000.0), rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
    max_position_embeddings=8192, model_type="llama")

# A tiny Llama for CPU runs (`--small`).
SMALL = dataclasses.replace(
    LLAMA_3_2_1B, vocab_size=512, hidden_size=128, intermediate_size=256,
    num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64)
