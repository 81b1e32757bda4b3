"""Errors in OpenAI's shape (`ApiError`: status, message, type, param, code), the one type
the OpenAI API's modules (`coordinator.front.openai_request`, `coordinator.front.openai_structured`,
`coordinator.front.http_api`, `coordinator.front.http_server`) answer a refused request with."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable_error", code="service_unavailable")
