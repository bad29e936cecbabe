"""Choosing tokens and what constrains them, per row: the draw (``sampling``), penalties and
logit bias (``penalties``), stop conditions and detokenization (``stops``), guided decoding's
grammars (``grammar``) and beam search's scoring (``beam_search``). Knows rows, not requests."""
