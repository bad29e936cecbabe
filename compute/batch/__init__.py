"""The requests a worker serves and how they are batched: the one map of requests and their
sequences (``registry``, ``requests``), the scheduler's policy over those sequences
(``scheduler``), admission against the model's limits (``admission``), beams as sequences that
share blocks (``beams``) and the logprobs each request collects (``logprobs``)."""
