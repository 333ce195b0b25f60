"""Every index backend, one file each: a `SearchIndex` subclass declared with its name, its spec, and how
it builds, loads and searches. `densekit.index.base.registered_backends` imports every module here on
first use (not `import densekit.index`), so each registers itself; a new backend is one new file here,
which no other module imports."""
