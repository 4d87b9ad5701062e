"""labkit.kv"""
