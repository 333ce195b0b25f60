"""Routing among the modules on one base: what a routing strategy is and its registry (`strategy`), the
strategies, one file each (`strategies`), the learned router two of them share (`router`), routes over
saved modules and their folders (`route`), a hypernetwork that generates a module per domain
(`hypernetwork`), and the one loader of a model folder or a route folder (`loading`).

It sits above encoding (a route encodes its queries in batches) and below retrieval (the `Retriever`
searches with a route).
"""
