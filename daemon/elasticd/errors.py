"""Errors the daemon reports to callers; control/service.py maps each to a gRPC code.

Kept free of grpc so the job logic can raise them without knowing how they
travel. Messages are for a person: say what is wrong and what to do.
"""


class ElasticdError(Exception):
    code = "INTERNAL"


class InvalidArgument(ElasticdError):
    code = "INVALID_ARGUMENT"


class NotFound(ElasticdError):
    code = "NOT_FOUND"


class PermissionDenied(ElasticdError):
    code = "PERMISSION_DENIED"


class FailedPrecondition(ElasticdError):
    code = "FAILED_PRECONDITION"


class AlreadyExists(ElasticdError):
    code = "ALREADY_EXISTS"


class ResourceExhausted(ElasticdError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ElasticdError):
    code = "UNAVAILABLE"


class Unauthenticated(ElasticdError):
    code = "UNAUTHENTICATED"
