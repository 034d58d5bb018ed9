"""Adaptively sparse attention / dynamic context pruning (papers.md section 3), all of it:

alpha_sigmoid.py   sigma_alpha (exact bisection + entmax gradient; an exact table for float32 training), the alpha
                   schedule
interaction.py     x_{n,j}, I_{k,j} and log I, the one survival rule, the sparsity loss, sparsity, drop records
patterns.py        the fixed local / strided baselines
compact_cache.py   the inference data structure (free-slot insert, delete by mask, compaction, doubling)
"""
from models.pruning.alpha_sigmoid import alpha_schedule, alpha_sigmoid
from models.pruning.compact_cache import CompactCache, CompactDecodeCache
from models.pruning.interaction import (ContextPruning, drop_records, mean_sparsity, pair_count, sparsity,
                                        sparsity_loss, survives)
from models.pruning.patterns import PATTERNS, pattern_allows, pattern_mask

__all__ = ["alpha_schedule", "alpha_sigmoid", "CompactCache", "CompactDecodeCache", "ContextPruning",
           "drop_records", "mean_sparsity", "pair_count", "sparsity", "sparsity_loss", "survives", "PATTERNS",
           "pattern_allows", "pattern_mask"]
