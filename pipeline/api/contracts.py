"""The read API's bodies as pydantic models: what requests send and responses answer.

The OpenAPI document's components are generated from these (:func:`component_schemas`,
used by :mod:`freshline.pipeline.api.openapi`), and the batch and predict bodies are validated by
them. A body the models refuse gets the answer the API has always given: the
``{"error": {"code", "message"}}`` of :mod:`freshline.pipeline.api.errors`, with the code, status
and message of the first problem in the order the checks have always run (the body's
shape, its size, the names, then the rest).

The batch read is the hottest route, so :func:`feature_selection` takes its common body
(non-empty lists, every feature set named by a string) with a few C-level checks and
asks the model only about the rest; :func:`freshness_fields` and :func:`predict_request`
do the same, since validating a small body by the model costs more than the checks
(``python -m bench.contracts``). A fast check accepts only bodies the model accepts, with
the same values (``tests/pipeline/api/test_contracts.py``).

The semantic cache's models (``Llm*``) document its bodies; :mod:`freshline.pipeline.api.llm`
checks their shape, and the cache refuses what its documented contract leaves out
(parameters that are not deterministic: ``not_deterministic``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Final

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    ValidationError,
)
from pydantic.json_schema import GenerateJsonSchema, SkipJsonSchema, models_json_schema
from pydantic_core import ErrorDetails

from freshline.pipeline.api.errors import ApiError
from freshline.pipeline.api.reader import AnswerSource
from freshline.pipeline.cache.tokens import TOKEN_CHARS, InvalidToken
from freshline.pipeline.core.errors import InvalidId
from freshline.pipeline.core.keys import is_plain_id, validate_id
from freshline.schemas.ids import ID_PATTERN, MAX_ID_LENGTH

MAX_MS: Final = 10**12
"""The largest ``max_staleness_ms`` or ``wait_ms`` taken (about 31 years)."""

TOKEN_PATTERN: Final = f"^[A-Za-z0-9_-]{{{TOKEN_CHARS}}}$"
"""A freshness token's shape (:mod:`freshline.pipeline.cache.tokens`): what a schema can check of
it."""

Id = Annotated[str, StringConstraints(pattern=f"^{ID_PATTERN.pattern}$", max_length=MAX_ID_LENGTH)]
"""An id that reaches keys (:mod:`freshline.schemas.ids`): tenants, entities, arms, models."""


def _absent_when_none(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def _sometimes(description: str) -> Any:
    """A response field that is left out, never null, when it does not apply."""
    return Field(default=None, description=description, json_schema_extra=_absent_when_none)


class ErrorDetail(BaseModel):
    code: str = Field(examples=["invalid_id", "unknown_feature_set"])
    message: str


class Error(BaseModel):
    """Every refusal and failure: a machine-readable code and a message in words."""

    error: ErrorDetail


class Features(BaseModel):
    """One entity's features for one feature set."""

    feature_set: str
    entity: str
    values: dict[str, Any] | None = Field(
        description="The named features; null for a cache-only miss in a batch."
    )
    hit: bool = Field(description="True if served from a cache.")
    source: AnswerSource = Field(
        description="local: the in-process tier; hit: Redis; waited: Redis, after waiting "
        "for another reader's computation or, for a read with after, for the consumer's "
        "write; computed: read through and cached; uncached: computed but not cached; "
        "miss: cache-only and not cached. local and hit are the cache; a read with after "
        "or max_staleness_ms only gets them for entries that meet both."
    )
    age_ms: int = Field(description="Milliseconds since computed.")
    schema_version: int
    took_ms: int | SkipJsonSchema[None] = _sometimes(
        "Only on reads with after or max_staleness_ms: milliseconds from the request's "
        "start until this answer was had (its wait and recompute)."
    )


class BatchResponse(BaseModel):
    schema_version: int
    items: list[Features] = Field(
        description="One per combination: for each entity in order, each feature set in order."
    )


def _integral(value: object) -> object:
    # JSON has one number type: 7.0 is the integer 7, as for entity ids.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Milliseconds = Annotated[int, Strict(), Field(ge=0, le=MAX_MS), BeforeValidator(_integral)]


class Freshness(BaseModel):
    """The freshness fields of a batch body (:mod:`freshline.pipeline.api.freshness`)."""

    max_staleness_ms: Milliseconds | None = Field(
        default=None,
        description="Answer only with values computed less than this many milliseconds "
        "ago; older entries are recomputed at once (0: always recompute).",
    )
    wait_ms: Milliseconds | None = Field(
        default=None,
        description="With after: how long to wait for the consumer's write before "
        "recomputing, in ms.",
    )
    # The token's shape is checked where it is decoded (freshline.pipeline.cache.tokens), after the
    # ids, with its own message; here it is only described.
    after: Annotated[str | None, Strict()] = Field(
        default=None,
        description="A freshness token from freshline.token() (SELECT freshline.token() in "
        "the writer's transaction after its writes, or right after commit): answer only "
        "with values computed from a database state at or after that commit. An entry "
        "that is not is waited for (the consumer's write, up to wait_ms), then recomputed. "
        "Opaque; a token that is malformed, altered or from another database is a 400 "
        "invalid_token.",
        json_schema_extra={"pattern": TOKEN_PATTERN},
    )


class FeatureSelection(BaseModel):
    feature_sets: list[Annotated[str, Strict()]] = Field(min_length=1)
    entities: list[Any] = Field(
        min_length=1,
        description="Entity ids, each checked as its feature sets' entity keys it.",
    )


class BatchRequest(Freshness, FeatureSelection):
    """len(feature_sets) x len(entities) must not exceed the batch limit
    (FRESHLINE_API_BATCH_LIMIT). Other fields are ignored: the tenant always comes from
    the API key."""


class PredictRequest(BaseModel):
    inputs: list[Any] = Field(
        min_length=1,
        description="Rows of numbers, each checked by the model's input conversion.",
        json_schema_extra={"items": {"type": "array", "items": {"type": "number"}}},
    )
    arm: Annotated[Id, Strict()] | None = Field(
        default=None,
        description="Experiment arm; kept apart in the cache. A string id (an integer is refused).",
    )


class PredictEntitiesRequest(Freshness):
    """The entity form: the server reads each entity's features that the model takes
    (its feature names, ``<feature_set>.<field>``) as a batch read does, and predicts
    on them. The prediction is keyed by those values, so a changed feature never gets
    an older prediction. after, max_staleness_ms and wait_ms apply to the feature
    reads. At most FRESHLINE_API_BATCH_LIMIT entities x feature sets."""

    entities: list[Any] = Field(
        min_length=1,
        description="Entity ids, each checked as the model's feature sets' entity keys it.",
    )
    arm: Annotated[Id, Strict()] | None = Field(
        default=None,
        description="Experiment arm; kept apart in the cache. A string id (an integer is refused).",
    )


class Prediction(BaseModel):
    value: Any = Field(description="The model's output for the row.")
    hit: bool
    entity: str | SkipJsonSchema[None] = _sometimes("Only in the entity form: whose row.")


class PredictResponse(BaseModel):
    model: str
    model_version: str
    arm: str | None
    predictions: list[Prediction]


class _Components(GenerateJsonSchema):
    """Property schemas without titles: the property's name says it."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


MODELS: Final[tuple[type[BaseModel], ...]] = (
    Error,
    Features,
    BatchRequest,
    BatchResponse,
    PredictRequest,
    PredictEntitiesRequest,
    PredictResponse,
)


def component_schemas(models: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """The OpenAPI ``components.schemas`` of ``models`` (and the models they use)."""
    _, found = models_json_schema(
        [(m, "validation") for m in models],
        ref_template="#/components/schemas/{model}",
        schema_generator=_Components,
    )
    schemas: dict[str, Any] = found["$defs"]
    for schema in schemas.values():  # a docstring's line breaks are not the text's
        if "description" in schema:
            schema["description"] = " ".join(schema["description"].split())
    return schemas


def _not_an_object() -> ApiError:
    return ApiError(422, "invalid_request", "the body must be a JSON object")


def _first(exc: ValidationError) -> ErrorDetails:
    """The problem the API names: a field's before its items', else the first."""
    return min(exc.errors(include_url=False), key=lambda e: len(e["loc"]) > 1)


def batch_size(feature_sets: int, entities: int, limit: int) -> None:
    """Refuse more than ``limit`` combinations."""
    if feature_sets * entities > limit:
        raise ApiError(
            422,
            "batch_too_large",
            f"{entities} entities x {feature_sets} feature sets is over "
            f"the limit of {limit} per request",
        )


def feature_selection(
    body: object, limit: int, known: Callable[[str], object]
) -> tuple[list[str], list[Any]]:
    """The feature sets and entities of a batch body, checked by :class:`FeatureSelection`,
    the batch ``limit``, and ``known`` (which raises for a name it does not know)."""
    if type(body) is not dict:
        raise _not_an_object()
    feature_sets = body.get("feature_sets")
    entities = body.get("entities")
    if not (
        type(feature_sets) is list
        and type(entities) is list
        and feature_sets
        and entities
        and set(map(type, feature_sets)) == {str}
    ):
        try:
            selection = FeatureSelection.model_validate(body)
        except ValidationError as exc:
            raise _selection_error(_first(exc), body, limit, known) from None
        feature_sets, entities = selection.feature_sets, selection.entities
    batch_size(len(feature_sets), len(entities), limit)
    for name in feature_sets:
        known(name)
    if len(set(feature_sets)) != len(feature_sets):
        raise ApiError(422, "invalid_request", "'feature_sets' names a feature set twice")
    return feature_sets, entities


def _selection_error(
    error: ErrorDetails, body: dict[str, Any], limit: int, known: Callable[[str], object]
) -> Exception:
    field = error["loc"][0]
    if len(error["loc"]) == 1:
        return ApiError(422, "invalid_request", f"{field!r} must be a non-empty JSON array")
    # Only items are wrong: the size comes first, then each name in order.
    batch_size(len(body["feature_sets"]), len(body["entities"]), limit)
    for name in body["feature_sets"]:
        if not isinstance(name, str):
            return InvalidId("feature set", name, "must be a string")
        known(name)
    return ApiError(422, "invalid_request", f"{field!r}: {error['msg']}")


def freshness_fields(body: Mapping[str, Any]) -> tuple[int | None, int | None, str | None]:
    """``max_staleness_ms``, ``wait_ms`` and ``after`` of a batch body, checked by
    :class:`Freshness` (whole integers and a string, or absent, take a C-level check)."""
    staleness = body.get("max_staleness_ms")
    wait = body.get("wait_ms")
    after = body.get("after")
    if _plain_ms(staleness) and _plain_ms(wait) and (after is None or type(after) is str):
        return staleness, wait, after
    try:
        fields = Freshness.model_validate(body)
    except ValidationError as exc:
        raise _freshness_error(_first(exc)) from None
    return fields.max_staleness_ms, fields.wait_ms, fields.after


def _plain_ms(value: object) -> bool:
    return value is None or (type(value) is int and 0 <= value <= MAX_MS)


def _freshness_error(error: ErrorDetails) -> Exception:
    field = error["loc"][0]
    if field == "after":
        return InvalidToken("'after' must be a freshness token (a string) or null")
    if error["type"] in ("greater_than_equal", "less_than_equal"):
        return ApiError(422, "invalid_request", f"{field} must be an integer from 0 to {MAX_MS}")
    return ApiError(422, "invalid_request", f"{field!r} must be an integer or null")


def predict_request(body: object, limit: int) -> tuple[list[Any], str | None]:
    """The rows and arm of a predict body, checked by :class:`PredictRequest` and the
    ``limit`` on rows. Its common body (rows in a list, no arm or a valid one) takes a
    few C-level checks, as :func:`feature_selection`'s does."""
    if type(body) is not dict:
        raise _not_an_object()
    inputs = body.get("inputs")
    arm = body.get("arm")
    if not (type(inputs) is list and inputs and (arm is None or is_plain_id(arm))):
        try:
            request = PredictRequest.model_validate(body)
        except ValidationError as exc:
            raise _predict_error(_first(exc), body, limit) from None
        inputs, arm = request.inputs, request.arm
    _predict_size(len(inputs), limit)
    return inputs, arm


def predict_entities(body: dict[str, Any]) -> tuple[list[Any], str | None]:
    """The entities and arm of a predict body in the entity form (``"entities"``, never
    with ``"inputs"``), checked by :class:`PredictEntitiesRequest`; the freshness fields
    are :func:`freshness_fields`' and the size is the caller's (it depends on the
    model's feature sets)."""
    if "inputs" in body:
        raise ApiError(
            422, "invalid_request", "a predict body takes 'inputs' or 'entities', not both"
        )
    entities = body["entities"]
    arm = body.get("arm")
    if not (type(entities) is list and entities and (arm is None or is_plain_id(arm))):
        try:
            request = PredictEntitiesRequest.model_validate({"entities": entities, "arm": arm})
        except ValidationError as exc:
            error = _first(exc)
            if error["loc"][0] == "entities":
                raise ApiError(
                    422, "invalid_request", "'entities' must be a non-empty array of ids"
                ) from None
            raise _arm_error(error, arm) from None
        entities, arm = request.entities, request.arm
    return entities, arm


def _predict_error(error: ErrorDetails, body: dict[str, Any], limit: int) -> Exception:
    if error["loc"][0] == "inputs":
        return ApiError(422, "invalid_request", "'inputs' must be a non-empty array of rows")
    _predict_size(len(body["inputs"]), limit)
    return _arm_error(error, body["arm"])


def _arm_error(error: ErrorDetails, arm: object) -> Exception:
    if not isinstance(arm, str):
        return ApiError(422, "invalid_request", "'arm' must be a string id or null")
    validate_id("arm", arm)  # raises InvalidId, naming the rule
    return ApiError(422, "invalid_request", f"'arm': {error['msg']}")


def _predict_size(rows: int, limit: int) -> None:
    if rows > limit:
        raise ApiError(
            422, "batch_too_large", f"{rows} inputs is over the limit of {limit} per request"
        )


# The semantic cache's bodies (freshline.pipeline.api.llm): components only when it is on.

Text = Annotated[str, StringConstraints(min_length=1, pattern=r"\S")]
"""Text the semantic cache takes: not blank."""


class LlmParams(BaseModel):
    """Generation parameters. Only temperature 0, or deterministic: true, may be cached
    (422 not_deterministic otherwise); other keys (max_tokens, stop, ...) must match
    exactly."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "anyOf": [
                {"required": ["temperature"], "properties": {"temperature": {"const": 0}}},
                {"required": ["deterministic"], "properties": {"deterministic": {"const": True}}},
            ]
        },
    )

    deterministic: bool | None = Field(
        default=None, description="A claim that the backend is deterministic; null: no claim."
    )


class _LlmScope(BaseModel):
    model: Id = Field(description="Model name (an id: letters, digits, _ . -)")
    model_version: Id
    template_version: Id = Field(description="Version of the prompt template (system prompt).")


class LlmLookupRequest(_LlmScope):
    prompt: Text
    params: LlmParams


class LlmLookupResponse(BaseModel):
    hit: bool
    response: str | SkipJsonSchema[None] = _sometimes("Only on a hit.")
    similarity: float | None = Field(
        description="Exact cosine similarity of the served entry (on a miss, of the best "
        "candidate, if any)."
    )
    threshold: float = Field(
        description="The similarity the deciding entry is served at now (learned per "
        "entry; without a candidate, a fresh entry's)."
    )
    estimated_error: float | SkipJsonSchema[None] = _sometimes(
        "The served (or explored) entry's estimated error at this similarity; a hit's is "
        "at most FRESHLINE_SEMANTIC_MAX_ERROR."
    )
    candidate_id: str | SkipJsonSchema[None] = _sometimes(
        "Only on a miss that explores: the entry that the store of this prompt's response "
        "will label. Nothing to do but store as usual."
    )
    age_ms: int | SkipJsonSchema[None] = _sometimes("Only on a hit.")
    entry_id: str | SkipJsonSchema[None] = _sometimes("Only on a hit; flag it if wrong.")


class LlmStoreRequest(_LlmScope):
    prompt: Text
    params: LlmParams
    response: Text
    generation_ms: float | None = Field(
        default=None, ge=0, description="What the model call took; feeds freshline advise."
    )


class LlmStoreResponse(BaseModel):
    stored: bool
    entry_id: str
    agreed: bool | SkipJsonSchema[None] = _sometimes(
        "Only when the store answered an exploration: whether the response was the "
        "explored candidate's (its label)."
    )


class LlmFlagRequest(_LlmScope):
    entry_id: str = Field(pattern="^[0-9a-fA-F]{16}$", description="16 hex digits.")
    prompt: Text | SkipJsonSchema[None] = _sometimes(
        "The prompt the hit was served for: a wrong outcome at its similarity, and the "
        "entry stays for closer prompts. Without it (or for the entry's own prompt) the "
        "entry is removed."
    )


class LlmFlagResponse(BaseModel):
    removed: bool
    entry_id: str
    similarity: float | SkipJsonSchema[None] = _sometimes("With a prompt.")
    threshold: float | SkipJsonSchema[None] = _sometimes(
        "With a prompt: the similarity the entry is served at now."
    )


LLM_MODELS: Final[tuple[type[BaseModel], ...]] = (
    LlmLookupRequest,
    LlmLookupResponse,
    LlmStoreRequest,
    LlmStoreResponse,
    LlmFlagRequest,
    LlmFlagResponse,
)
