"""The worker's loop: the process-lifetime ``Engine`` and its connection-lifetime ``Session``
(``engine``, ``session``), and one owner per one-step lag: the model step (``model_step``,
``launched``), the kvstore's Step (``kvsync``) and the Redis job (``publisher``), with the
intake of new requests (``intake``), the lease heartbeat, retries and the step timeline."""
