"""labkit.sim"""
