"""A stand-in of chengzeyi/Comfy-WaveSpeed's "Apply First Block Cache" node (ApplyFBCacheOnModel), in the module the
real pack defines it in (fbcache_nodes), for tests/server_e2e/test_first_block_cache.py. The tests' own code."""
from .fbcache_nodes import ApplyFBCacheOnModel

NODE_CLASS_MAPPINGS = {"ApplyFBCacheOnModel": ApplyFBCacheOnModel}
