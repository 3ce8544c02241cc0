"""Activation memory per transformer layer: the bytes autograd keeps for backward, counted, next to the
accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Table 2), term by term.

counting.py counts what a forward saves (saved-tensor hooks); paper.py holds the paper's terms; gpt2_block.py
names each tensor the reference GPT-2 block saves and says why its bytes differ from the paper's term;
llama_block.py derives the Llama block's closed form term by term, beside the GPT-2 terms each replaces;
term_table.py holds the Row and the tally both share; measure.py builds a block in a configuration and counts
it (for the tests and the benchmark).
"""
