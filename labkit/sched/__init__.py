"""labkit.sched"""
