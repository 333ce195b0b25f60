"""The service's routes, a module for each group, each adding its own to an app over a `SearchService`."""
