"""What several processes share, owned by none of them: the Redis contract between the gateway
and the compute workers (``queue_keys``, ``records``, ``queue_worker``, ``queue_gateway``), model
metadata (``model_config``), tokenizer loading (``tokenizer``), where the kvstore listens
(``endpoints``) and a service's garbage-collector set-up (``heap``). Torch-free: the services
import it; it imports none of them.
"""
