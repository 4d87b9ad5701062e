"""labkit.train"""
