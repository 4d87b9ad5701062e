"""labkit.quant"""
