"""Beyond one replica: a router over ``labkit serve`` replicas (policies, health, failover,
canary) and the process launcher that starts a local cluster.
"""
