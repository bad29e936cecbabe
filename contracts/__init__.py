"""What several processes share, owned by none of them: the Redis contract between the gateway
and the compute workers (``queue_keys``, ``records``, ``queue_worker``, ``queue_gateway``), model
metadata (``model_config``), tokenizer loading (``tokenizer``) and where the kvstore listens
(``endpoints``). Torch-free: the services import it; it imports none of them.
"""
