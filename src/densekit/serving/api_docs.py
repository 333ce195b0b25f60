"""The API's docs pages, `/docs` (Swagger UI) and `/redoc`, with their scripts, styles and icon served by
the service itself from the fastapi-offline package, where FastAPI's defaults fetch them from a CDN (and
fonts and an icon from two other sites): the pages then work on a machine without a network, and the
browser that opens them asks nothing of another host."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

ASSETS_PATH = "/docs-assets"
# The files the pages load, as fastapi-offline ships them, and their media types.
ASSETS = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}


def add_api_docs(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve `docs_url` and `redoc_url` on `app` (made with `docs_url=None, redoc_url=None`, so that
    FastAPI adds none of its own), and the files they load under ASSETS_PATH. Like the OpenAPI
    description they show, they hold no data and need no token; the service's Host check applies."""
    folder = files("fastapi_offline") / "static"

    def asset_url(request: Request, name: str) -> str:
        return f"{request.scope.get('root_path', '')}{ASSETS_PATH}/{name}"

    def openapi_url(request: Request) -> str:
        return f"{request.scope.get('root_path', '')}{app.openapi_url}"

    @app.get(docs_url, include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url(request),
            title=f"{app.title} - Swagger UI",
            swagger_js_url=asset_url(request, "swagger-ui-bundle.js"),
            swagger_css_url=asset_url(request, "swagger-ui.css"),
            swagger_favicon_url=asset_url(request, "favicon.png"),
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    @app.get(redoc_url, include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url(request),
            title=f"{app.title} - ReDoc",
            redoc_js_url=asset_url(request, "redoc.standalone.js"),
            redoc_favicon_url=asset_url(request, "favicon.png"),
            with_google_fonts=False,
        )

    @app.get(ASSETS_PATH + "/{name}", include_in_schema=False)
    def asset(name: str) -> FileResponse:
        if name not in ASSETS:  # only the files named, never a path into the package
            raise HTTPException(404, f"no docs file {name!r}")
        with_path = folder / name
        return FileResponse(
            str(with_path), media_type=ASSETS[name], headers={"Cache-Control": "max-age=86400"}
        )
