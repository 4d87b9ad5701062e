"""labkit.spec"""
