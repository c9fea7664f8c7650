from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SearchRequest(_message.Message):
    __slots__ = ("queries", "topk", "return_scores")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    RETURN_SCORES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedScalarFieldContainer[str]
    topk: int
    return_scores: bool
    def __init__(self, queries: _Optional[_Iterable[str]] = ..., topk: _Optional[int] = ..., return_scores: _Optional[bool] = ...) -> None: ...

class Document(_message.Message):
    __slots__ = ("id", "contents")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    contents: str
    def __init__(self, id: _Optional[str] = ..., contents: _Optional[str] = ...) -> None: ...

class ScoredDocument(_message.Message):
    __slots__ = ("document", "score")
    DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    document: Document
    score: float
    def __init__(self, document: _Optional[_Union[Document, _Mapping]] = ..., score: _Optional[float] = ...) -> None: ...

class QueryResult(_message.Message):
    __slots__ = ("documents",)
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[ScoredDocument]
    def __init__(self, documents: _Optional[_Iterable[_Union[ScoredDocument, _Mapping]]] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[QueryResult]
    def __init__(self, results: _Optional[_Iterable[_Union[QueryResult, _Mapping]]] = ...) -> None: ...
